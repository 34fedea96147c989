"""invariant-norm-grad for Cohere's LayerNorm (no bias, computed in float32, weight applied in
float32), recomputed by the stock formula - installed only where that gives the module's own
forward's bits on a seeded input:
- a per-head one, whose weight holds one row per head ([heads, head_dim]: q_norm/k_norm under
  use_qk_norm, cut like the heads at TP > 1 by models/plans_hf.py): the weight goes through
  kernels/head_rows.py, whose weight grad sums each head by a call of one shape at every TP (and,
  with micro-batches, into an fp32 carry head by head);
- a replicated one ([hidden]: the layers' input_layernorm, the final norm): stock outside grad
  accumulation; inside its window the weight grad goes into an fp32 carry in fixed token blocks
  (CarryScale, as a replicated RMSNorm's in fixes/norm.py). nn.LayerNorm's carry does not cover it:
  the module has no normalized_shape and its formula is not F.layer_norm's bits.
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


def _xhat(x, eps: float):
    """Cohere's normalised input in float32 (transformers' CohereLayerNorm.forward)."""
    xf = x.to(torch.float32)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return (xf - mean) * torch.rsqrt(var + eps)


def _head_ln(x, w, eps: float, site=None):
    """Cohere's LayerNorm, a [heads, head_dim] weight through HeadRowsScale."""
    return HeadRowsScale.apply(_xhat(x, eps), w, site).to(x.dtype)


def _row_ln(x, w, eps: float, site=None):
    """Cohere's LayerNorm, a [hidden] weight through CarryScale (float32 xhat times w: the bits of
    w.to(float32) * xhat)."""
    from tpdiag.kernels.carry_functions import CarryScale

    return CarryScale.apply(_xhat(x, eps), w, site).to(x.dtype)


def cohere_layernorm_like(mod) -> bool:
    """A LayerNorm-named module with a 1-D or 2-D weight, no bias, no normalized_shape (not
    nn.LayerNorm: fixes/norm.py carries that one), an eps, whose forward (its plan style's, which
    runs on the local rows) is this formula's bits."""
    w = getattr(mod, "weight", None)
    eps = _eps(mod)
    if not (type(mod).__name__.endswith("LayerNorm") and isinstance(w, torch.Tensor) and w.dim() in (1, 2)
            and getattr(mod, "bias", None) is None and eps is not None
            and getattr(mod, "normalized_shape", None) is None):
        return False
    wl = _local(w)
    if wl.device == torch.device("meta"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *wl.shape, generator=g).to(device=wl.device, dtype=wl.dtype)
    try:
        with torch.no_grad():
            ref, y = mod.forward(x), (_head_ln if wl.dim() == 2 else _row_ln)(x, wl, eps)
    except Exception:  # noqa: BLE001 - a forward that takes no such input: not this formula
        return False
    return (isinstance(ref, torch.Tensor) and ref.dtype == y.dtype and ref.shape == y.shape
            and torch.equal(ref.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))


def wrap_cohere_layernorm(name: str, mod):
    """Install the forward on `mod`; returns its previous own forward (a plan style's) or None."""
    from torch.distributed.tensor import DTensor

    from tpdiag.kernels import grad_carry

    own = mod.__dict__.get("forward")
    orig = mod.forward
    eps = _eps(mod)
    per_head = mod.weight.dim() == 2

    def forward(x, *args, **kwargs):
        w = mod.weight
        site = grad_carry.site(w, f"{name}.weight") if grad_carry.is_open() and w.requires_grad else None
        if per_head:
            # the rank's rows of a weight cut like the heads; to_local keeps its grad a Shard(0) DTensor's
            return _head_ln(_local(x), _local(w), eps, site)
        if args or kwargs or site is None or isinstance(w, DTensor) or isinstance(x, DTensor):
            return orig(x, *args, **kwargs)
        return _row_ln(x, w, eps, site)

    mod.forward = forward
    return own
