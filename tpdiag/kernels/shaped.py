"""A GEMM result put in its caller's shape without becoming a view of it.

Why: the fixes' GEMMs compute on [rows, K] and hand back [..., N]. A reshape of that temporary is a
view, and an autograd.Function whose output is a view may not have it modified in place - a user's
model that scales a Linear's output in place (transformers' Gemma3n: `per_layer_projection *=
scale`) then fails under the fixes where the stock nn.Linear does not: aten's matmul returns its
result through `_unsafe_view`, which is the same storage but no view for autograd. Safe where the
source is a temporary of the caller (nothing else holds it, no backward saved it); the bits are
the same tensor's.
"""
from __future__ import annotations

import torch


def shaped(t: torch.Tensor, *shape) -> torch.Tensor:
    return torch.ops.aten._unsafe_view(t, shape)
