"""A py: target whose plan shards nothing: every degree must be bitwise equal to TP=1."""
import torch

import tpdiag
from tpdiag.models import tiny_llama


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    return tpdiag.Target(model=model, plan={}, vocab_size=model.cfg.vocab_size)
