"""The invariant-attention fix: every F.scaled_dot_product_attention call made while the fix is
on runs tpdiag's invariant attention (tpdiag/kernels/attention.py).

Installed as a TorchFunctionMode, so it catches the call however the caller reached it (the
built-in models, transformers' sdpa_attention_forward, a py: model's own call) without
editing model code. DTensor q/k/v (all sharded on the head dim, or all replicated, on one
mesh) run on their local shards - attention is independent per head - and are wrapped back
with the same placements; any other DTensor layout is refused in one line.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpdiag.errors import BadInput

SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bind(args, kwargs) -> dict:
    bound = dict(zip(_NAMES, args))
    for k, v in kwargs.items():
        if k not in _NAMES:
            raise BadInput(f"invariant-attention: scaled_dot_product_attention argument {k!r} is not supported")
        bound[k] = v
    return bound


def _local(bound: dict):
    """DTensor q/k/v -> (local q/k/v, a function that wraps the output back)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    qkv = [bound[n] for n in ("query", "key", "value")]
    isd = [isinstance(t, DTensor) for t in qkv]
    mask = bound.get("attn_mask")
    if not any(isd) and not isinstance(mask, DTensor):
        return None
    if not all(isd) or isinstance(mask, DTensor):
        raise BadInput("invariant-attention: q/k/v must be all DTensors or all plain tensors, and a DTensor "
                       "attn_mask is not supported")
    pl = qkv[0].placements
    ok = all(t.placements == pl and t.device_mesh == qkv[0].device_mesh for t in qkv)
    if not ok or not all(p == Replicate() or p == Shard(1) for p in pl):
        raise BadInput(f"invariant-attention: DTensor q/k/v placements {[t.placements for t in qkv]} are not "
                       "supported (all Shard(1) on heads or all Replicate, on one mesh)")
    for n, t in zip(("query", "key", "value"), qkv):
        bound[n] = t.to_local()
    mesh = qkv[0].device_mesh
    return lambda o: DTensor.from_local(o, mesh, pl, run_check=False)


class _HeadExpand(torch.autograd.Function):
    """A per-head [1, H, 1, 1] tensor expanded over batch and queries (gpt_oss's attention sinks,
    concatenated to the logits). Backward: each head's grad summed over one contiguous
    [batch, queries, 1] block - the same reduction at every TP - where expand's own backward
    reduces [batch, H/TP, queries, 1] at once, another CPU reduction path when a rank holds one
    head (3 ULP on gpt_oss's sinks at TP=4)."""

    @staticmethod
    def forward(ctx, t, sizes):
        return t.expand(*sizes)

    @staticmethod
    def backward(ctx, g):
        per_head = [g[:, h].contiguous().sum() for h in range(g.shape[1])]
        return torch.stack(per_head).reshape(1, -1, 1, 1), None


def _head_expand(args, kwargs):
    """(tensor, sizes) of a `[1, H, 1, 1].expand(B, H or -1, Q, 1 or -1)` on a grad-requiring
    tensor, else None."""
    if kwargs or not args or type(args[0]) is not torch.Tensor:  # plain tensors only (no DTensor)
        return None
    t, sizes = args[0], args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if not t.requires_grad or t.dim() != 4 or len(sizes) != 4 or t.shape[0] != 1 \
            or t.shape[2] != 1 or t.shape[3] != 1 or sizes[1] not in (-1, t.shape[1]) \
            or sizes[3] not in (-1, 1):
        return None
    return t, tuple(int(x) for x in sizes)


# Set while tpdiag re-executes a module in float64 (probes/float64.py, the oracle): there every op
# computes in float64 and the attention wanted is the exact one, which the stock SDPA gives in
# float64; the invariant kernel exists for the low-precision bits of the real run and refuses
# float64 q/k/v - under `--fix all` that refusal left every attention's float64 verdict
# unformed (a sliding-window decode read `unknown`: tests/test_decode_sliding_window.py).
_EXACT = threading.local()


@contextmanager
def exact_attention():
    """Inside: scaled_dot_product_attention runs stock even while the fix is on."""
    was = getattr(_EXACT, "on", False)
    _EXACT.on = True
    try:
        yield
    finally:
        _EXACT.on = was


class InvariantSDPAMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_EXACT, "on", False):
            return func(*args, **kwargs)
        if func is torch.Tensor.expand:
            he = _head_expand(args, kwargs)
            if he is not None:
                return _HeadExpand.apply(*he)
            return func(*args, **kwargs)
        if func is not SDPA:
            return func(*args, **kwargs)
        from tpdiag.kernels.attention import invariant_sdpa

        bound = _bind(args, kwargs)
        wrap = _local(bound)
        out = invariant_sdpa(**bound)
        return wrap(out) if wrap is not None else out


@contextmanager
def invariant_attention():
    mode = InvariantSDPAMode()
    mode.__enter__()
    try:
        yield mode
    finally:
        mode.__exit__(None, None, None)


def attention_fix(model=None, plan=None, world: int = 1):
    return invariant_attention()
