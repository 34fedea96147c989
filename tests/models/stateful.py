"""Models whose step changes their own state, which a second run must not see (the self-check's
restore, runner/pristine.py): a buffer counting forward calls, and a plain attribute set on the
first call, each scaling the output once it is set - a run from a stale state computes other
values than a run from the build's. And a build that is not reproducible (os.urandom noise in the
init): one build per world, so only the reference rerun can tell."""
import os

import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


class CountingBuffer(tiny_llama.TinyLlama):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float32))

    def forward(self, *a, **k):
        out = super().forward(*a, **k)
        scale = 1 + 1e-3 * self.calls
        self.calls += 1
        return out * scale


class LazyFlag(tiny_llama.TinyLlama):
    def forward(self, *a, **k):
        out = super().forward(*a, **k)
        if getattr(self, "_warm", False):  # absent after the build
            out = out * 1.001
        self._warm = True
        return out


def _cfg():
    return tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})


def counting():
    cfg = _cfg()
    return tpdiag.Target(model=CountingBuffer(cfg), plan=llama_plan(), vocab_size=cfg.vocab_size)


def lazy():
    cfg = _cfg()
    return tpdiag.Target(model=LazyFlag(cfg), plan=llama_plan(), vocab_size=cfg.vocab_size)


def unreproducible():
    cfg = _cfg()
    model = tiny_llama.TinyLlama(cfg)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        w = model.layers[0].ffn_norm.weight
        w.add_(1e-3 * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=cfg.vocab_size)
