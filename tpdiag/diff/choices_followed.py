"""Whether a backward float64 verdict through a module with discrete choices was made on the runs' own
choices, so that a far verdict there is a wrong grad and not a flipped near tie (helper hbwd18).

A grad judged by a module's float64 backward (its own weight grads, the output grad of the module it
consumes) is made from that module's forward re-executed in float64 from the side's own inputs
(probes/float64.module_oracle_grads). Where that forward makes a choice on floating values (an MoE
router's top-k) that rounding could order otherwise, the float64 forward may route a token to another
expert than the run did, and its backward is then the grad of another function: O(1) off with no bug.
So such a verdict was dropped (oracle_flip), and a wrong backward past the first divergence - a shared
expert's input grad all-reduced with the routed experts' partial grads, N times at TP=N
(tests/models/planted/moe_bwd_bug.py) - read `rounding only`.

The same inputs give the same float64 forward: the module's own forward record, judged against the
very re-execution its backward starts from, shows which choices it made. A flipped choice moves its
token's output row by that expert's share of it - O(1) of the row, not a rounding; so where EVERY row
of the module's forward output is within ROW_ROUNDINGS roundings of the float64 value, on both sides,
the float64 run chose as the runs did and its backward is the exact grad of what each side computed.
A row that is further (a flip, or a row rounding cannot be told apart from one), or a value not kept,
leaves the verdict unjudged (the finding's cause `unknown`: fail closed).

Not shown by this: a flipped choice whose expert carries under ROW_ROUNDINGS roundings of its row (a
near-zero router weight); such a flip moves the backward by as little, under the far margin too.
"""
from __future__ import annotations

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.records.layout import first_positions

# an output row of a module re-executed in float64 from the same inputs is a handful of roundings of
# its dtype from it (moe_bwd_bug.py, fp32: 2.5 at most, the residual add included); a flipped top-k choice
# moves its token's row by the flipped expert's weight times the experts' difference
ROW_ROUNDINGS = 16.0


def forward_followed(dd, module: str, step, ops) -> str | None:
    """The key of `module`'s forward output record of `step` whose every row, on both sides, is within
    ROW_ROUNDINGS roundings of its float64 re-execution from that side's own inputs; None unless every
    forward output record of the module in that step is (and at least one is there), and every choice
    in `ops` (the backward's) was read by the forward itself: a choice only its backward reads (a
    max's values used, its grad routed to the argmax) moves no forward row when it flips."""
    from tpdiag.diff.oracle import notes_for

    own = getattr(dd, "oracle_own", None) or {}
    ref = getattr(dd, "oracle", None) or {}
    keys = [r["key"] for r in dd.rows if r["phase"] == "forward" and r["kind"] == "out"
            and r["module"] == module and r["step"] == step]
    if not keys:
        return None
    for k in keys:
        row = next(r for r in dd.rows if r["key"] == k)
        if not set(ops) <= set(notes_for(dd, row).get("discrete") or ()):
            return None
        pair = dd.tensors.get(k)
        o_n, o_ref = own.get(k), ref.get(k)
        if pair is None or o_n is None or not all(isinstance(t, torch.Tensor) for t in pair):
            return None
        y_ref, y_n = pair
        if not _rows_near(y_n, first_positions(o_n, y_n, row.get("positions"))):
            return None
        if o_ref is not None:
            if not _rows_near(y_ref, first_positions(o_ref, y_n, row.get("positions"))):
                return None
        elif not _near(row.get("oracle")):
            # the reference's world kept only the norms of its re-execution: its forward verdict
            # (both sides within a few roundings, its reference not a flip's distance: no_reference)
            return None
    return keys[0]


def _near(v) -> bool:
    return isinstance(v, dict) and v.get("far") is False and not v.get("no_reference")


def _rows_near(y: torch.Tensor, o: torch.Tensor) -> bool:
    if y.shape != o.shape or y.dim() == 0 or not y.is_floating_point():
        return False
    u = UNIT_ROUNDOFF.get(y.dtype)
    if u is None:
        return False
    a, b = y.to(torch.float64).reshape(-1, y.shape[-1]), o.to(torch.float64).reshape(-1, y.shape[-1])
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return False
    err = torch.linalg.vector_norm(a - b, dim=-1)
    size = torch.linalg.vector_norm(b, dim=-1)
    # a row of zeros (a padded token) is no value a flip or rounding moves: it must stay zero
    return bool((err <= ROW_ROUNDINGS * u * size).all())


def forward_flipped(dd, module: str, step) -> bool:
    """Whether `module`'s float64 forward of `step` shows that it chose otherwise than a run: its
    output records all kept whole, with their re-executions, and a row of one side beyond
    ROW_ROUNDINGS roundings of its float64 value (a flipped top-k choice moves its token's row by
    the flipped expert's share of it). A row further for another reason - a wrong forward - is
    the forward verdict's to judge; a value not kept shows nothing (False: the verdict stands)."""
    own = getattr(dd, "oracle_own", None) or {}
    ref = getattr(dd, "oracle", None) or {}
    rows = [r for r in dd.rows if r["phase"] == "forward" and r["kind"] == "out" and r["module"] == module
            and r["step"] == step]
    flipped = False
    for row in rows:
        pair, o_n, o_ref = dd.tensors.get(row["key"]), own.get(row["key"]), ref.get(row["key"])
        if pair is None or o_n is None or not all(isinstance(t, torch.Tensor) for t in pair):
            return False
        y_ref, y_n = pair
        for y, o in ((y_n, o_n), (y_ref, o_ref)):
            if o is None:
                continue
            o = first_positions(o, y_n, row.get("positions"))
            if not _comparable(y, o):
                return False
            flipped = flipped or not _rows_near(y, o)
    return flipped


def _comparable(y: torch.Tensor, o: torch.Tensor) -> bool:
    return y.shape == o.shape and y.dim() > 0 and y.is_floating_point() and y.dtype in UNIT_ROUNDOFF \
        and bool(torch.isfinite(y).all()) and bool(torch.isfinite(o).all())
