"""A decode that goes wrong only late: past position 56, each one-token call scales its final
hidden state by (1 + 2^-20) - a bug that shows only on long rollouts (a cache index off by one
past a block boundary, a stale page). Everything before position 56 is the plain model's, so
under `--fix all` decode is prefill's bits up to there. A rerun of only the first positions
(runner/prefix.py: the prompt and 16 one-token calls, positions 0..47 at seq 64) cannot see it:
the region pass must fall back to every position."""
import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan

LATE = 56


class Late(torch.nn.Module):
    def __init__(self, scale: float = 1 + 2.0 ** -20):
        super().__init__()
        self.scale = scale

    def forward(self, h, pos: int):
        return h * self.scale if pos >= LATE and h.shape[1] == 1 else h


class LateDecode(tiny_llama.TinyLlama):
    def __init__(self, cfg, scale: float = 1 + 2.0 ** -20):
        super().__init__(cfg)
        self.late = Late(scale)

    def forward(self, input_ids, cache=None):
        start = cache.length if cache is not None else 0
        S = input_ids.shape[1]
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]
        h = self.tok_embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, **({} if cache is None else {"kv": cache.layers[i]}))
        return self.output(self.norm(self.late(h, start)))


def target(scale: float = 1 + 2.0 ** -20):
    cfg = tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})
    return tpdiag.Target(model=LateDecode(cfg, scale), plan=llama_plan(), vocab_size=cfg.vocab_size)


def bug_target():
    """The late scale a bug (x 1.5), beside stock decode's early rounding differences."""
    return target(1.5)
