"""A later-step mistake in the drifted regime: the built-in tiny-llama (bfloat16, AdamW at lr 1e-2), its
forward at step 1 some 15x further from the reference's than at step 0 (each degree's weights are its own
update's), with a max-norm constraint on each output row of every layer's `w2` (row-parallel: a row's
columns are split over the ranks), applied to what the last update wrote, from the second training step on.

  maxnorm_local  the row norms are the rank's shard's (`weight.to_local()`): each rank rescales its
                 columns by its own factor - a bug from step 1 on
  maxnorm_whole  the twin: the norms of the whole rows (`full_tensor()`)

    tpdiag compare --model py:tests/models/planted/drift_llama.py:maxnorm_local --tp 1,2 --steps 3 --dtype bfloat16
"""
import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan

MAX_NORM = 0.2  # w2's rows are drawn with norm ~0.23 (std 0.01 over 512 columns)


class MaxNormFeedForward(tiny_llama.FeedForward):
    def __init__(self, cfg, whole):
        super().__init__(cfg)
        self.whole = whole
        self.seen = 0

    @torch.no_grad()
    def _constrain(self):
        from torch.distributed.tensor import DTensor

        w = self.w2.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        rows = w.full_tensor() if self.whole and isinstance(w, DTensor) else local
        sq = rows.float().pow(2).sum(1, keepdim=True)
        local.mul_((MAX_NORM / sq.sqrt().clamp_min(1e-12)).clamp(max=1.0).to(local.dtype))

    def forward(self, x):
        if self.training:
            self.seen += 1
            if self.seen > 1:
                self._constrain()
        return super().forward(x)


def _target(whole):
    model = tiny_llama.build("tiny-llama")
    for layer in model.layers:
        ff = MaxNormFeedForward(model.cfg, whole)
        ff.load_state_dict(layer.feed_forward.state_dict())
        layer.feed_forward = ff
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)


def maxnorm_local():
    return _target(False)


def maxnorm_whole():
    return _target(True)
