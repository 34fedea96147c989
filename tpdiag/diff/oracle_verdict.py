"""Bug or rounding, for any module or op: the verdict from a float64 re-execution (an oracle).

The reference world of a second pass re-executes the first divergent module (its own forward)
and the ops it records in float64, from the reference's own inputs and parameters
(probes/float64.py). Here, for a record whose inputs were bitwise equal at both sides (so the
oracle's value is the exact answer for BOTH), with o the float64 value:

    e_ref = ||y_ref - o||,   e_N = ||y_N - o||,   s = ||o||          (2-norms, float64)
    level = max(e_ref, u s)      u: the unit roundoff of the record's dtype (fp32 2**-24, bf16 2**-8)
    far   <=>  e_N > A(n) level, A(n) = 8 for n >= 16 outputs, 8 * 16 / n below (margin())

far is a wrong result (`sharding-bug`); near is rounding (the reordering cause named by the
record's layout or by the ops inside it). Backward records are judged the same way against the
module's backward run again in float64 from the output grad it received (probes/float64.py,
module_oracle_grads): a weight grad of the module, and the grad_out of the module that produced
its one input (that input's grad), when everything the module saw - inputs, parameters, output
grad - was bitwise equal.

Why a pure reordering is never called far. A reordering evaluates the same function of the same
inputs, only summing, blocking or splitting differently; its error against the exact value is a
sum of the same per-operation roundings (each at most u times an intermediate the two sides
share) that make the reference's own error e_ref, which is measured here for this very module,
data and dtype - its conditioning (cancellation, a softmax's exp, a norm's 1/sigma) included.
What a reordering may add is a handful of roundings per output (TP=N rounds up to N partial
sums, Higham's gamma_K grows with the blocking), which over many outputs moves the 2-norm by a
small factor, inside A; and no side can be closer than rounding its result once (u s),
hence the floor.
A 2-norm over n outputs is an average of n rounding errors; for a handful of outputs the two
sides' errors are few independent draws, so A grows as 16/n below 16 outputs; over many
outputs they concentrate, so A narrows towards 3 (benchmarks/jobs/oracle_threshold.py measures
the smallest planted error still called a bug, per dtype and size). Measured on CPU
(tests/test_oracle.py; 5 seeds, K = 64..4096, N = 2, 4, 8, every partial rounded to the output
dtype): split-K matmuls summed in several orders, distributed LayerNorm statistics and softmaxes
of reordered logits reach e_N/level <= 1.10 in fp32 and <= 1.32 in bf16; planted mistakes reach
>= 6e4 in fp32 and, in bf16, 17 (a LayerNorm over half the width), 355 (a reversed gather) and
4.7 (a bias of 0.02 added twice: under A, so not called a bug - in bf16 a mistake that small is
inside what one rounding of the output can move). The hand-written layers of
tests/models/planted land 1e4-1e6 beyond in fp32, their correct twins at e_N/level of about 1.
Discrete choices: when the re-execution made a discrete choice on floating values (top-k,
argmax, a comparison: probes/float64_mode.DISCRETE), a rounding difference upstream of it inside the
module can flip it and move the output by O(1); a far result is then not called a bug (the
cause stays `unknown`, saying so).
"""
from __future__ import annotations

import math

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF

MARGIN = 8.0
SMALL = 16  # outputs below this many elements widen the margin as 16/n
# Above 16 outputs the margin stays 8. A margin narrowing as 3 + 5 sqrt(16/n) was tried: it called
# a correct MLA model's replicated weight grad a bug (dots3 at TP=2, kv_a_proj_with_mqa: the two
# ranks' partial grads summed, e_N / e_ref = 3.86 at n = 2560 against A = 3.40) - a reordering can
# reach several times the reference's own error where few roundings dominate, so 8 it is.
MARGIN_LARGE = MARGIN


def margin(n: int) -> float:
    """A for a record of n elements: the 2-norm of n rounding errors concentrates as n grows
    (its relative spread ~ 1/sqrt(2n)), so the factor a reordering can reach over the
    reference's own error shrinks from 8 at 16 outputs towards MARGIN_LARGE; below 16 outputs
    the two sides' errors are few independent draws and it widens as 16/n."""
    if n < SMALL:
        return MARGIN * SMALL / n
    return MARGIN_LARGE + (MARGIN - MARGIN_LARGE) * math.sqrt(SMALL / n)



def judge(y_ref: torch.Tensor, y_n: torch.Tensor, o: torch.Tensor, partials: float = 0.0) -> dict | None:
    """The verdict for one record (see the module doc), or None when it cannot be formed
    (shapes differ, non-finite values: those are findings of their own). Its float64 norms on the
    parent's check device where it has one (diff/on_device.py). partials: sqrt(sum_r ||p_r||^2)
    of the rank partials this side rounded and summed (diff/rank_partials.py), 0 where none."""
    from tpdiag.diff import on_device

    return on_device.run(_judge, y_ref, y_n, o, partials)


def _judge(y_ref: torch.Tensor, y_n: torch.Tensor, o: torch.Tensor, partials: float = 0.0) -> dict | None:
    if y_ref.shape != y_n.shape or tuple(o.shape) != tuple(y_ref.shape):
        return None
    if not (y_ref.is_floating_point() or y_ref.is_complex()):
        return None
    cd = torch.complex128 if o.is_complex() or y_ref.is_complex() else torch.float64
    a, b, r = (t.to(cd) for t in (y_ref, y_n, o))
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
            and bool(torch.isfinite(r).all())):
        return None
    n = max(1, a.numel())
    e_ref = float(torch.linalg.vector_norm(a - r))
    e_n = float(torch.linalg.vector_norm(b - r))
    s = float(torch.linalg.vector_norm(r))
    return _verdict(e_ref, e_n, s, n, UNIT_ROUNDOFF.get(y_ref.dtype, UNIT_ROUNDOFF[torch.float32]), partials)


def _verdict(e_ref: float, e_n: float, s: float, n: int, u: float, partials: float = 0.0) -> dict:
    """judge()'s verdict from its norms (module doc); partials: judge()'s."""
    # rounding each rank's partial once is a rounding the reference never made: where the
    # partials cancel it dwarfs e_ref and u s (diff/rank_partials.py)
    level = max(e_ref, u * s, u * partials)
    margin_ = margin(n)
    thr = margin_ * level
    ratio = e_n / thr if thr > 0 else (0.0 if e_n == 0 else math.inf)
    rel = (lambda e: e / s) if s > 0 else (lambda e: e)
    return {"far": e_n > thr, "ratio": ratio, "ref_err": rel(e_ref), "err": rel(e_n),
            "floor": u if s > 0 else 0.0, "margin": margin_, "threshold": rel(thr),
            "relative": s > 0, "n": n}


def judge_own(y_ref: torch.Tensor, y_n: torch.Tensor, o_ref: torch.Tensor | None, o_n: torch.Tensor,
              ref_norms: torch.Tensor | None = None, partials: float = 0.0) -> dict | None:
    """_judge_own on the parent's check device where it has one (diff/on_device.py)."""
    from tpdiag.diff import on_device

    return on_device.run(_judge_own, y_ref, y_n, o_ref, o_n, ref_norms, partials)


def _judge_own(y_ref: torch.Tensor, y_n: torch.Tensor, o_ref: torch.Tensor | None, o_n: torch.Tensor,
               ref_norms: torch.Tensor | None = None, partials: float = 0.0) -> dict | None:
    """A record past the first divergence, judged on its own inputs: o_n is the reference's
    module re-executed in float64 from THIS side's inputs (diff/own_inputs.py), o_ref from the
    reference's. Each side's relative distance from its own exact value; this side far when
        e_N / ||o_N|| > A * max(e_ref / ||o_ref||, u)
    - the reference's own error on its own inputs measures this computation's rounding (its
    conditioning included), as in judge(); without o_ref only the one-rounding floor u.
    ref_norms: [||o_ref||, ||y_ref - o_ref||] where the reference's world kept those instead of
    o_ref (probes/oracle_hooks.NORMS; NaN in the second where the shapes differed there)."""
    got = _judge(y_n, y_n, o_n)
    if got is None:
        return None
    cd = torch.complex128 if o_n.is_complex() or y_n.is_complex() else torch.float64
    s_n = float(torch.linalg.vector_norm(o_n.to(cd)))
    e_n = float(torch.linalg.vector_norm(y_n.to(cd) - o_n.to(cd)))
    return _own_verdict(got, y_ref, y_n, o_ref, ref_norms, s_n, e_n, cd, partials)


def _own_verdict(got: dict, y_ref, y_n, o_ref, ref_norms, s_n: float, e_n: float, cd, partials: float = 0.0) -> dict:
    """_judge_own's verdict from this side's norms (got: _judge(y_n, y_n, o_n)'s); partials:
    this side's rank partials' norm (judge()'s)."""
    u = UNIT_ROUNDOFF.get(y_ref.dtype, UNIT_ROUNDOFF[torch.float32])
    ref_rel = 0.0
    if o_ref is not None and tuple(o_ref.shape) == tuple(y_ref.shape) and y_ref.shape == y_n.shape:
        s_r = float(torch.linalg.vector_norm(o_ref.to(cd)))
        e_r = float(torch.linalg.vector_norm(y_ref.to(cd) - o_ref.to(cd)))
        if math.isfinite(e_r):
            ref_rel = e_r / s_r if s_r > 0 else e_r
    elif o_ref is None and ref_norms is not None and y_ref.shape == y_n.shape:
        s_r, e_r = (float(x) for x in ref_norms.to(torch.float64).reshape(-1)[:2])
        if math.isfinite(e_r):
            ref_rel = e_r / s_r if s_r > 0 else e_r
    if s_n == 0:
        return {**got, "own": True}
    level = max(ref_rel, u, u * partials / s_n)
    err = e_n / s_n
    thr = got["margin"] * level
    return {"far": err > thr, "ratio": err / thr, "ref_err": ref_rel, "err": err, "floor": u,
            "margin": got["margin"], "threshold": thr, "relative": True, "n": got["n"], "own": True}
