"""`tpdiag rollout`: a rollout engine's per-token logprobs against the trainer's, recomputed.

read.py reads the engine's file (vLLM, SGLang, tpdiag's JSONL), compute.py recomputes the
trainer's logprobs in each configuration tried (recompute.py runs every configuration: TP=1 here,
TP > 1 in worlds), metrics.py and processed.py judge them, run.py runs it and summary.py puts the verdict together.
"""
