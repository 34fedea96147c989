"""How far rounding may move a record no check judged (relative 2-norm, in roundings of its dtype),
and how far a record pair moved: the one limit compare's class (diff/classes.py), the gate
(gate/degree.py), its moved-record check (diff/moved_records.cut) and dropped_hooks read."""
from __future__ import annotations

# How far (relative 2-norm), in roundings of the grads' dtype, an activation grad no check judged may
# move and still be called rounding (compare's class, and so the gate: it is the same rule). Rounding
# moved the built-in tiny-llama's by ~20 eps (float32: 2.5e-6, two micro-batches, two steps; bfloat16:
# 0.0987 = 13 eps at TP=4, two steps - near 0.1, so no fixed number serves every dtype); a grad made
# twice (Megatron's f in front of a replicated module) moves by ~1. In bfloat16 1000 eps is 7.8 (float16:
# 0.98) - no limit at all: a bf16 two_paths:pair_f, its block's grad a quarter off (0.251) while no
# check judged it, read rounding and passed `gate --allow rounding`. So the limit is also at most
# NOT_JUDGED_MAX_REL of the grad's norm in any dtype: twice the most rounding moved a correct model's
# unjudged grads (0.0987, bf16; llama 8B and a 70B slice on H200, bf16: 0.081, 0.034 - docs/scale.md),
# and below a doubled share of a grad. A bug that moves an unjudged grad by less than that in bf16
# still reads rounding (docs/causes.md, Not covered). After a router flip (rounding-class, discrete)
# grads move by O(1) with no bug: not applied there.
NOT_JUDGED_ROUNDINGS = 1000
NOT_JUDGED_MAX_REL = 0.2
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def moved_limit(dtypes) -> float:
    """How far (relative 2-norm) rounding may move a record no check judged: NOT_JUDGED_ROUNDINGS eps of
    the least precise of `dtypes` (names, "torch." or not; none known: bfloat16's), at most
    NOT_JUDGED_MAX_REL - the one limit of moved_beyond, cut and dropped_hooks._not_idle."""
    eps = [EPS[d] for d in (str(d).replace("torch.", "") for d in dtypes) if d in EPS]
    return min(NOT_JUDGED_ROUNDINGS * max(eps or [EPS["bfloat16"]]), NOT_JUDGED_MAX_REL)


def moved_beyond(entry: dict, dtypes: list | None = None) -> tuple[float, float] | None:
    """(how far the unjudged grads moved, the limit) where they moved beyond NOT_JUDGED_ROUNDINGS eps
    of the least precise of `dtypes` (the listed records' dtypes; None: summary.json's own word, then
    bfloat16's) or beyond NOT_JUDGED_MAX_REL, else None. Such a degree is not judged (class unknown,
    diff/classes.py) and the gate fails it as cause unknown (gate/degree.py) - one rule, so compare
    never says "nothing is wrong" where the gate fails the run."""
    nj = entry.get("not_judged")
    moved = nj.get("rel_l2") if isinstance(nj, dict) else None
    if not isinstance(moved, (int, float)) or isinstance(moved, bool):
        return None
    found = [f for f in [entry.get("first_divergence"), *(entry.get("findings") or ())] if isinstance(f, dict)]
    if any(f.get("cause") == "router-flip" for f in found):
        # a discrete choice made otherwise within rounding (an MoE router's near-tie): the tokens
        # after it run other experts, and their grads move by O(1) with no bug (tests/test_moe.py)
        return None
    if dtypes is None:
        dtypes = [nj.get("dtype")]
    limit = moved_limit(dtypes)
    if moved == moved and moved <= limit:
        return None
    return float(moved), limit


def rel_l2(pair) -> float | None:
    """||this side - reference|| / ||reference|| in float64: how far the grad as a whole moved. The
    elementwise max_rel is no size to show here: an element the reference holds near zero makes it
    any number (1e27 in a correct llama's residual-stream grads), while rounding moves the whole
    grad by ~1e-6 (float32) to ~1e-2 (bf16) and a doubled grad by ~1."""
    import torch

    if pair is None:
        return None
    a, b = pair
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
            or not a.is_floating_point():
        return None
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    ref = float(a64.norm())
    d = float((b64 - a64).norm())
    if not (d == d and ref == ref) or ref == 0.0:
        return None
    return d / ref
