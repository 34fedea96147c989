"""`tpdiag rollout`: a rollout engine's per-token logprobs against the trainer's, recomputed.

read.py reads the engine's file (vLLM, SGLang, tpdiag's JSONL), compute.py recomputes the
trainer's logprobs in each configuration tried, metrics.py and processed.py judge them, run.py
puts it together.
"""
