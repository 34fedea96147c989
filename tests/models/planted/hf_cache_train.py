"""A user's own Phi-3 (transformers' Phi3ForCausalLM, tiny, made from its config in code: no files,
no network) trained with the config transformers gives it: `use_cache` left true, so every training
forward builds a DynamicCache that each attention call appends its keys and values to (helper
hown20, found by hnew20 on a saved Phi-3 checkpoint). Their hand-written TP plans:

  cache_mlp_bug   layer 0's MLP split as a plain Linear pair: `gate_up_proj` ColwiseParallel, but
                  its rows are [gate; up] fused, so rank 0 holds the whole gate and rank 1 the whole
                  up, and the MLP's own chunk(2) pairs halves of the one with halves of itself - a
                  wrong function (BUG at model.layers.0.mlp). Everything after it differs by that
                  bug; layer 1's attention is correct and unsharded.
  cache_row_ok    the twin: layer 0's attention output projection row-split (RowwiseParallel from a
                  replicated input: each rank's columns, then an all-reduce) - a correct model that
                  differs by the reduction's rounding from there on.

Before the fix the float64 re-execution of layer 1's attention from TP=2's own inputs ran on the
cache the real call had already appended to (a Python object the input snapshot kept by
reference): it attended over 32 and more keys, and a correct attention read `sharding-bug`.

    tpdiag compare --model py:tests/models/planted/hf_cache_train.py:cache_mlp_bug --tp 1,2 --dtype bfloat16
"""
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag


def _model():
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                     tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    assert cfg.use_cache  # what transformers gives: the training forward builds a DynamicCache
    torch.manual_seed(0)
    model = Phi3ForCausalLM(cfg)
    with torch.no_grad():  # weights large enough that a wrong function is far beyond bf16 rounding
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    return model.to(torch.bfloat16)


def cache_mlp_bug():
    model = _model()
    mlp = "model.layers.0.mlp."
    plan = {mlp + "gate_up_proj": ColwiseParallel(), mlp + "down_proj": RowwiseParallel()}
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.config.vocab_size)


def cache_row_ok():
    model = _model()
    plan = {"model.layers.0.self_attn.o_proj": RowwiseParallel(input_layouts=Replicate())}
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.config.vocab_size)
