"""The float64 arithmetic diff/optim_step.py judges a capture's optimizer step by: torch's update rule
re-run from one side's own parameter, grad and state (link 1), and the consumed grad fitted as one factor
times the recorded grad, whole or per rank shard (link 2). The records and the verdicts are optim_step's."""
from __future__ import annotations

import math

import torch

RERUN = ("torch.optim.adamw.AdamW", "torch.optim.adam.Adam", "torch.optim.sgd.SGD")
# how a step is computed, not what: another choice rounds otherwise, it never changes the update
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "initial_lr")
# roundings of each element's own magnitude (|p| before, |update|) one float32 optimizer step makes:
# a weight decay multiply, a moment lerp, a sqrt, a division, an add - a few each
STEP_ROUNDINGS = 16
# roundings of |c g| per element between the recorded and the consumed grad: one multiply by c
SCALE_ROUNDINGS = 4
EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


# the hyper-parameters each re-run models; another key (a newer torch's) is refused: not judged
_ADAM = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
_SGD = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def rerun(cls: str, hyper: dict, before: torch.Tensor, grad: torch.Tensor, state: dict, step) -> torch.Tensor:
    """The parameter after one step of torch optimizer `cls` (a RERUN name) with `hyper`, in float64
    from `before`, `grad` and the state tensors `state` (empty at the first step): torch's update rule
    written out (its own step() would import torch._dynamo, seconds per diff), ValueError for a
    hyper-parameter it does not model."""
    f64 = torch.float64
    p, g = before.detach().to(f64), grad.detach().to(f64)
    st = {k: v.detach().to(f64) for k, v in state.items()}
    known = _SGD if cls == "torch.optim.sgd.SGD" else _ADAM
    odd = sorted(k for k in hyper if k not in known)
    if odd:
        raise ValueError(f"hyper-parameter {odd[0]!r} not modelled")
    lr, wd = float(hyper.get("lr", 1e-3)), float(hyper.get("weight_decay", 0.0) or 0.0)
    if hyper.get("maximize"):
        g = -g
    if cls == "torch.optim.sgd.SGD":
        if wd:
            g = g + wd * p
        mom = float(hyper.get("momentum", 0.0) or 0.0)
        if mom:
            buf = st.get("momentum_buffer")
            buf = g if buf is None else buf * mom + (1 - float(hyper.get("dampening", 0.0) or 0.0)) * g
            g = g + mom * buf if hyper.get("nesterov") else buf
        return p - lr * g
    b1, b2 = (float(x) for x in hyper.get("betas", (0.9, 0.999)))
    eps = float(hyper.get("eps", 1e-8))
    decoupled = cls == "torch.optim.adamw.AdamW" or bool(hyper.get("decoupled_weight_decay"))
    if wd and decoupled:
        p = p * (1 - lr * wd)
    elif wd:
        g = g + wd * p
    m = st.get("exp_avg", torch.zeros_like(p)) * b1 + (1 - b1) * g
    v = st.get("exp_avg_sq", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
    t = float(step or 0) + 1
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    if hyper.get("amsgrad"):
        v = torch.maximum(st.get("max_exp_avg_sq", torch.zeros_like(p)), v)
    return p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)


def _own_excess(before, after, p64) -> float:
    """max |after - p64| / its rounding allowance (STEP_ROUNDINGS eps of |before| + |update|)."""
    eps = EPS.get(after.dtype, EPS[torch.bfloat16])
    b64, a64 = before.to(torch.float64), after.to(torch.float64)
    allow = STEP_ROUNDINGS * eps * (b64.abs() + (p64 - b64).abs()) + torch.finfo(after.dtype).tiny
    return float(((a64 - p64).abs() / allow).max()) if a64.numel() else 0.0


def fit(rec: torch.Tensor, used: torch.Tensor, terms: int = 1, mag=None) -> tuple[float, bool]:
    """(c, clean): the consumed grad `used` as c times the recorded `rec`, clean where every element is
    within SCALE_ROUNDINGS roundings of |c rec| (plus the dtype's smallest normal); `terms`: one of the two
    is a sum of that many ranks' shares, rounded once per term; mag: the sum of those shares' magnitudes
    (a sum that cancels rounds by its terms' size, not its own)."""
    r, u = rec.to(torch.float64).reshape(-1), used.to(torch.float64).reshape(-1)
    rr = float(r.dot(r))
    if rr == 0.0:
        return 1.0, bool((u == 0).all())
    c = float(r.dot(u)) / rr
    eps = EPS.get(used.dtype, EPS[torch.bfloat16])
    size = (c * r).abs() if mag is None else (c * r).abs() + mag.reshape(-1)
    allow = SCALE_ROUNDINGS * terms * eps * size + torch.finfo(used.dtype).tiny
    return c, bool(((u - c * r).abs() <= allow).all())


def _per_rank(rec, used, layout: str | None, ranks: int) -> list[float] | None:
    """The factors of each rank's shard of a `shard:D` grad, where each shard is a clean multiple."""
    if not layout or not layout.startswith("shard:") or ranks < 2:
        return None
    d = int(layout.split(":")[1])
    if rec.dim() <= d or rec.shape[d] % ranks:
        return None
    cs = []
    for r, u in zip(rec.chunk(ranks, d), used.chunk(ranks, d)):
        c, clean = fit(r, u)
        if not clean:
            return None
        cs.append(c)
    return cs
