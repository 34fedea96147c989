"""invariant-norm-grad for a per-head LayerNorm whose weight holds one row per head ([heads,
head_dim]: Cohere's q_norm/k_norm under use_qk_norm, cut like the heads at TP > 1 by
models/plans_hf.py). Its forward is recomputed by the stock formula - installed only where that
gives the module's own forward's bits on a seeded input - with the weight applied through
kernels/head_rows.py, whose weight grad sums each head by a call of one shape at every TP.
"""
from __future__ import annotations

import torch

from tpdiag.kernels.head_rows import HeadRowsScale


def _eps(mod) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        if isinstance(getattr(mod, attr, None), float):
            return getattr(mod, attr)
    return None


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _head_ln(x, w, eps: float):
    """Cohere's LayerNorm (transformers' CohereLayerNorm.forward), the weight through HeadRowsScale."""
    xf = x.to(torch.float32)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return HeadRowsScale.apply((xf - mean) * torch.rsqrt(var + eps), w).to(x.dtype)


def head_layernorm_like(mod) -> bool:
    """A LayerNorm-named module with a 2-D weight ([heads, head_dim]), no bias, an eps, whose
    forward (its plan style's, which runs on the local rows) is _head_ln's bits."""
    w = getattr(mod, "weight", None)
    eps = _eps(mod)
    if not (type(mod).__name__.endswith("LayerNorm") and isinstance(w, torch.Tensor) and w.dim() == 2
            and getattr(mod, "bias", None) is None and eps is not None):
        return False
    wl = _local(w)
    if wl.device == torch.device("meta"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *wl.shape, generator=g).to(device=wl.device, dtype=wl.dtype)
    try:
        with torch.no_grad():
            ref, y = mod.forward(x), _head_ln(x, wl, eps)
    except Exception:  # noqa: BLE001 - a forward that takes no such input: not this formula
        return False
    return (isinstance(ref, torch.Tensor) and ref.dtype == y.dtype and ref.shape == y.shape
            and torch.equal(ref.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))


def wrap_head_layernorm(mod):
    """Install the per-head forward on `mod`; returns its previous own forward (a plan style's) or None."""
    own = mod.__dict__.get("forward")
    eps = _eps(mod)

    def forward(x, *args, **kwargs):
        # the rank's rows of a weight cut like the heads; to_local keeps its grad a Shard(0) DTensor's
        return _head_ln(_local(x), _local(mod.weight), eps)

    mod.forward = forward
    return own
