"""A record past the first divergence judged on its own inputs from the figures the own-input
pass's reference kept of its float64 re-execution from this side's inputs (probes/own_side_norms.py)
instead of the value: diff/oracle.judge_own's verdict, by its own arithmetic (_verdict, _own_verdict)."""
from __future__ import annotations

import math

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.diff.oracle import _own_verdict, _verdict


def judge_own_side(y_ref: torch.Tensor, y_n: torch.Tensor, o_ref: torch.Tensor | None, side: torch.Tensor,
                   hash_version: int, ref_norms: torch.Tensor | None = None, partials: float = 0.0) -> dict | None:
    """judge_own where the reference's world kept, of its re-execution o_n from this side's inputs,
    only [||o_n||, ||y_n - o_n||, o_n finite, numel, y_n's hash] (probes/own_side_norms.py): the
    same verdict from the same figures. REFUSED where that hash is not this side's record's (the
    figures were taken against another value): no verdict from them."""
    from tpdiag.probes.own_side_norms import E, FINITE, HASH_HI, HASH_LO, NUMEL, S, WIDTH
    from tpdiag.records.hashing import tensor_hash

    f = [float(x) for x in side.to(torch.float64).reshape(-1)]
    if len(f) != WIDTH or not all(math.isfinite(f[i]) for i in (FINITE, NUMEL, HASH_LO, HASH_HI)):
        return REFUSED
    if int(f[HASH_LO]) | (int(f[HASH_HI]) << 32) != int(tensor_hash(y_n, hash_version), 16) \
            or int(f[NUMEL]) != y_n.numel():
        return REFUSED
    # judge_own's _judge(y_n, y_n, o_n): a plain floating pair, both finite
    if not y_n.is_floating_point() or f[FINITE] != 1.0 or not bool(torch.isfinite(y_n).all()):
        return None
    s_n, e_n = f[S], f[E]
    got = _verdict(e_n, e_n, s_n, max(1, y_n.numel()), UNIT_ROUNDOFF.get(y_n.dtype, UNIT_ROUNDOFF[torch.float32]))
    return _own_verdict(got, y_ref, y_n, o_ref, ref_norms, s_n, e_n, torch.float64, partials)


# judge_own_side's answer where the figures are not of this side's record
REFUSED = {"refused": "the reference world's norms of its float64 re-execution from this side's inputs were "
                      "taken against another value than this side's record"}
