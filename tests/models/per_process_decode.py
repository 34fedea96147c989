"""A decode reproducible within a process but not across processes: each decode run re-seeds its
noise from the process id at its prompt call, so a world's unprobed and probed runs agree (its
self-check passes) while two passes' worlds do not. A rerun of the first positions must see that
its logits are not pass 1's (runner/prefix.py) and rerun every position instead."""
import os

import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


class PerProcessDecode(tiny_llama.TinyLlama):
    def forward(self, input_ids, cache=None):
        out = super().forward(input_ids, cache=cache)
        if cache is None:
            return out
        if input_ids.shape[1] > 1:  # the prompt call: a fresh draw sequence for this run
            self._g = torch.Generator().manual_seed(os.getpid())
        return out + 1e-3 * torch.randn(out.shape, generator=self._g, dtype=out.dtype)


def target():
    cfg = tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})
    return tpdiag.Target(model=PerProcessDecode(cfg), plan=llama_plan(), vocab_size=cfg.vocab_size)
