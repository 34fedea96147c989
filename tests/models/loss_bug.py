"""Planted loss bug (Megatron-LM issue 7452's symptom): at TP > 1 the loss is off by log(TP)."""
import math

import torch.distributed as dist
import torch.nn.functional as F

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def loss(logits, labels):
    world = dist.get_world_size() if dist.is_initialized() else 1
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
    return ce + math.log(world)


def target():
    model = tiny_llama.build("tiny-llama", n_layers=1)
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size, loss=loss)
