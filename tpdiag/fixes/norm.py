"""Install the TP-invariant RMSNorm on the modules the plan marks sequence-parallel, and on
per-head norms whose weight grad the plan all-reduces (transformers' q_norm/k_norm).

Applied at TP=1 too (same plan, same canonical order). Only RMSNorm-like modules (a `weight`
of the hidden size and an `eps`/`variance_epsilon`, no bias) are handled; anything else under
a SequenceParallel style is refused in one line rather than silently left stock.

Every other RMSNorm and every LayerNorm (replicated: no style in the plan) is wrapped for grad
accumulation (kernels/grad_carry.py): inside an open window its weight's (and a LayerNorm's
bias's) grad goes into the window's fp32 carry in token blocks (CarryScale, CarryLayerNorm);
outside one it runs stock. Why a LayerNorm needs it (issue 61: its grads 3.5e-10 apart between
1 x 4 and 4 x 1 micro-batches while every carried grad was equal): its weight and bias grads are
sums over the tokens, and without a carry each micro-batch's kernel call sums its own tokens,
rounds, and the pieces are added into .grad one by one - another association than one sum over
every token. (On the CPU, one thread, torch's kernel sums the rows it is given in an order that
does not depend on how many there are - zero-grad rows appended leave its bits unchanged,
tests/test_accumulate_gpt2.py - so the pieces' adding is the whole difference there; a GPU
kernel's row blocking may add to it.) A module whose forward is not the stock formula bit
for bit (checked once as the fix installs, on a seeded input) is left stock (accumulate_grads
then names its parameters as not carried).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from tpdiag.errors import BadInput
from tpdiag.kernels import tree
from tpdiag.kernels.norm_grad import OffsetRMSNormSP, RMSNormSP

# set on a per-head norm whose forward and backward this fix took over: the weight-grad all-reduce
# transformers' replicated_with_grad_allreduce does (tpdiag.models.hf_plan) is then its backward's
HEAD_NORM_FIXED = "_tpdiag_head_norm_fixed"


def _eps(mod) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        if isinstance(getattr(mod, attr, None), float):
            return getattr(mod, attr)
    return None


def _rms(x, eps: float):
    """RMSNorm's normalised input, as the built-in and transformers' Llama/Qwen norms compute it."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_like(mod) -> bool:
    w = getattr(mod, "weight", None)
    return (type(mod).__name__.endswith("RMSNorm") and _eps(mod) is not None and w is not None
            and w.dim() == 1 and getattr(mod, "bias", None) is None)


def _same_as_stock(mod, eps: float) -> bool:
    """Does w * _rms(x) give the module's own forward's bits? (A Gemma-style (1 + w) norm: no.)"""
    w = mod.weight
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        ref, y = mod.forward(x), _rms(x, eps) * w  # forward: no hooks
    return (ref.dtype == y.dtype and ref.shape == y.shape
            and torch.equal(ref.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))


def _rms_offset(x, w, eps: float):
    """Gemma's / Qwen3-Next's RMSNorm: (x_hat * (1 + w)) in float32, then x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def _styled_same_as_stock(mod, eps: float, formula=None) -> bool:
    """_same_as_stock for a norm a plan style shards or replicates: the class's own forward (not the
    style's hooks) on a replicated copy of the seeded input where the weight is a replicated
    DTensor. A weight sharded some other way is taken as the stock formula (not checked).
    formula(x, w, eps): the formula checked; default w * _rms(x)."""
    from torch.distributed.tensor import DTensor, Replicate

    if formula is None:
        def formula(x, w, eps):
            return _rms(x, eps) * w

    w = mod.weight
    if not isinstance(w, DTensor):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 3, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            ref, y = type(mod).forward(mod, x), formula(x, w, eps)
    elif all(isinstance(p, Replicate) for p in w.placements):
        wl = w.to_local()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 3, wl.shape[0], generator=g).to(device=wl.device, dtype=wl.dtype)
        with torch.no_grad():
            ref = type(mod).forward(mod, DTensor.from_local(x, w.device_mesh, list(w.placements), run_check=False))
            ref, y = (ref.to_local() if isinstance(ref, DTensor) else ref), formula(x, wl, eps)
    else:
        return True
    return (ref.dtype == y.dtype and ref.shape == y.shape
            and torch.equal(ref.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))


def _ln_like(mod) -> bool:
    """nn.LayerNorm, or a module of that shape (a class named ...LayerNorm with normalized_shape,
    eps, a weight and maybe a bias) whose forward is F.layer_norm's bits (_same_as_stock)."""
    w = getattr(mod, "weight", None)
    return (type(mod).__name__.endswith("LayerNorm") and isinstance(getattr(mod, "eps", None), float)
            and isinstance(w, torch.Tensor) and tuple(getattr(mod, "normalized_shape", ())) == tuple(w.shape)
            and (getattr(mod, "bias", None) is None or getattr(mod, "bias").shape == w.shape))


def _ln_same_as_stock(mod) -> bool:
    import torch.nn.functional as F

    w, b = mod.weight, mod.bias
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *w.shape, generator=g).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        ref, y = mod.forward(x), F.layer_norm(x, tuple(w.shape), w, b, mod.eps)
    return (ref.dtype == y.dtype and ref.shape == y.shape
            and torch.equal(ref.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)))


def _wrap_layernorm(name: str, mod):
    """Grad accumulation's carries for a replicated LayerNorm's weight and bias."""
    from torch.distributed.tensor import DTensor

    from tpdiag.kernels import grad_carry
    from tpdiag.kernels.carry_functions import CarryLayerNorm

    own = mod.__dict__.get("forward")
    orig = mod.forward
    shape, eps = tuple(mod.weight.shape), mod.eps

    def forward(x, *args, **kwargs):
        w, b = mod.weight, mod.bias
        trains = [t for t in (w, b) if t is not None and t.requires_grad]
        if (args or kwargs or not grad_carry.is_open() or not trains
                or any(isinstance(t, DTensor) for t in (x, w, b))):
            return orig(x, *args, **kwargs)
        sw = grad_carry.site(w, f"{name}.weight") if w.requires_grad else None
        sb = grad_carry.site(b, f"{name}.bias") if b is not None and b.requires_grad else None
        return CarryLayerNorm.apply(x, w, b, shape, eps, sw, sb)

    mod.forward = forward
    return own


def _wrap_replicated(name: str, mod):
    """Grad accumulation's carry for a replicated RMSNorm's weight (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    from tpdiag.kernels import grad_carry
    from tpdiag.kernels.carry_functions import CarryScale

    own = mod.__dict__.get("forward")
    orig = mod.forward
    eps = _eps(mod)

    def forward(x, *args, **kwargs):
        w = mod.weight
        if (args or kwargs or not grad_carry.is_open() or not w.requires_grad
                or isinstance(w, DTensor) or isinstance(x, DTensor)):
            return orig(x, *args, **kwargs)
        return CarryScale.apply(_rms(x, eps), w, grad_carry.site(w, f"{name}.weight"))

    mod.forward = forward
    return own


def _heads_dim(x) -> int:
    """The heads dim of a per-head norm's input: -2 for [B, S, heads, D] (Qwen3 normalises before
    the transpose), -3 for [B, heads, S, D] (Gemma3 after it). The heads are the projection's inner
    dim, so in a view of its output they have the smaller stride; a tie (one local head) is -2: a
    rank with one head cuts it into one group, along any dim. Cut along the sequence instead, the
    groups of TP=1 (S/G rows) and TP=2 are other sums: Gemma3's k_norm weight grad, 64 ULP."""
    return -3 if x.dim() >= 4 and x.stride(-3) < x.stride(-2) else -2


def _head_groups(heads: int, world: int, what: str) -> int:
    """Groups of a per-head norm's weight grad: gcd(heads, G), the same at every degree of the run
    (G and the model's head count are), whole heads each, a whole number per rank wherever the
    degree divides the heads. G alone failed a model with fewer heads than G (a TP=1 rollout's G is
    8: a 4-head Qwen3's --fix all configurations failed, 'reduced dimension 4 is not divisible by 8
    groups'; Qwen3-30B-A3B has 4 KV heads)."""
    import math

    tree.check(tree.n_groups(), world, what)  # G itself: a power of two the degree divides
    g = math.gcd(heads, tree.n_groups())
    if g % world:
        raise BadInput(f"{what}: {heads} heads cannot be cut into {world} ranks' whole groups")
    return g


@contextmanager
def norm_fix(model: nn.Module, plan: dict, world: int):
    from torch.distributed.tensor import DTensor, Shard

    from tpdiag.records.styles import style_of

    from tpdiag.fixes.norm_heads import cohere_layernorm_like, wrap_cohere_layernorm

    wrapped, replicated = [], []
    try:
        for name, mod in model.named_modules():
            style = style_of(name, plan or {})
            if cohere_layernorm_like(mod):  # Cohere's: per-head q/k norms cut like the heads, and replicated ones
                replicated.append((mod, wrap_cohere_layernorm(name, mod)))
                continue
            if style not in ("sequence", "replicatedwithgradallreduce"):
                if style is not None or isinstance(getattr(mod, "weight", None), DTensor) \
                        or getattr(getattr(mod, "weight", None), "device", None) == torch.device("meta"):
                    continue
                if _rms_like(mod) and _same_as_stock(mod, _eps(mod)):
                    replicated.append((mod, _wrap_replicated(name, mod)))
                elif _ln_like(mod) and not isinstance(getattr(mod, "bias", None), DTensor) \
                        and _ln_same_as_stock(mod):
                    replicated.append((mod, _wrap_layernorm(name, mod)))
                continue
            # sequence parallel: tokens sharded on dim 1; a per-head norm (transformers'
            # replicated_with_grad_allreduce, Qwen3's q_norm/k_norm): heads sharded on dim -2
            gdim = 1 if style == "sequence" else -2
            eps = _eps(mod)
            if eps is None or getattr(mod, "bias", None) is not None or not hasattr(mod, "weight"):
                if style != "sequence":
                    # a per-head norm of another kind (Phi's qk_layernorm: a LayerNorm with a bias) under
                    # transformers' grad all-reduce: left stock, all-reduce included, as Gemma's are, so
                    # a norm-weight-grad there stays unconfirmed rather than failing the whole run
                    continue
                raise BadInput(f"--fix invariant-norm-grad: {name} ({type(mod).__name__}) is not an "
                               "RMSNorm; only RMSNorm is supported under SequenceParallel")
            try:
                other = not _styled_same_as_stock(mod, eps)
            except Exception:  # noqa: BLE001 - a forward that takes no seeded input here: installed as before
                other = False
            kernel = RMSNormSP
            if other:
                # a norm of another formula must keep it (w * rms(x) in place of Gemma's x * (1 + w)
                # moved a tiny Gemma3's logprobs 0.67 nats): Gemma's / Qwen3-Next's (1 + w) has a
                # kernel of its own (its weight grad summed by the stock formula's terms); any other
                # formula is left stock, so a norm-weight-grad there stays unconfirmed
                try:
                    offset = style != "sequence" and _styled_same_as_stock(mod, eps, _rms_offset)
                except Exception:  # noqa: BLE001 - not this formula either
                    offset = False
                if not offset:
                    continue
                kernel = OffsetRMSNormSP

            def forward(x, _mod=mod, _eps=eps, _name=name, _gdim=gdim, _style=style, _kernel=kernel):
                xl = x.to_local() if isinstance(x, DTensor) else x
                if _gdim != 1:
                    _gdim = _heads_dim(xl)
                if _gdim == 1:
                    groups = tree.check(xl.shape[_gdim] * world, world, f"{_name} (sequence length)")
                else:
                    groups = _head_groups(xl.shape[_gdim] * world, world, f"{_name} (heads)")
                w = _mod.weight
                wl = w.to_local() if isinstance(w, DTensor) else w
                y = _kernel.apply(xl, wl, _eps, groups // world, _gdim)
                if isinstance(w, DTensor) and _style == "sequence":
                    return DTensor.from_local(y, w.device_mesh, [Shard(1)], run_check=False)
                return y

            mod.forward = forward
            setattr(mod, HEAD_NORM_FIXED, True)  # its weight-grad all-reduce is this backward's now
            wrapped.append(mod)
        yield
    finally:
        for mod in wrapped:
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop(HEAD_NORM_FIXED, None)
        for mod, own in replicated:
            if own is not None:
                mod.forward = own
            else:
                mod.__dict__.pop("forward", None)
