"""An input grad that more than its module consumer made: `h = h + blk(h)` in the parent's forward.

A grad_out record of X is judged against the float64 backward of the one module that read X's
output (records/keys.sole_consumer). Where the parent's own code also reads that output - a
residual add outside any module - the grad is the SUM of the consumer's input grad and the grad
that flows through the add, and the consumer's float64 value alone is no exact value of it: the
reference itself is O(1) away (a planted model's embedding grad: 153% from it), and a threshold
scaled by that distance judged nothing - a doubled input grad read "rounding only"
(tests/test_other_paths.py).

The add passes its output's grad through unchanged, so the other path's grad is the grad of the
add's output, which is the grad_out record of the module whose output was added (the block's).
It is found from the records: among the grad_out records of the same step and shape recorded
before this one (backward made them first; the nearest CANDIDATES), the first p for which the
reference matches o + p far better than o alone. o + p (this side's own p past the first divergence) is then the exact value
of the sum for each side, up to one rounding of the add (the floor u ||o||). A reference far
from o that no such p explains is not judged: never rounding against a value the reference
itself is far from."""
from __future__ import annotations

import torch

# the reference's relative distance from a value above which that value is no reference for it:
# far beyond any dtype's rounding (bf16's unit roundoff is 0.4%); as diff/oracle_own.NO_REFERENCE
NO_REFERENCE = 0.05
# how much closer o + p must bring the reference than o alone to call p the other path: an
# unrelated grad added moves it further away; the true path leaves only the rounding (1e-7 in fp32)
BETTER = 8.0

# how many earlier grad_out records of its shape are tried (a float64 norm of the whole tensor
# each, for every judged input grad: all of them was quadratic in the depth of the model)
CANDIDATES = 8

UNEXPLAINED = ("its consumer's float64 backward is no exact value of it: the reference is {:.2e} from it "
               "(relative 2-norm), so the grad also flows outside that module (a residual add in the "
               "parent's code) and no recorded grad explains the rest - not judged")


def _dist(y: torch.Tensor, v: torch.Tensor) -> float:
    y64 = y.to(torch.float64)
    s = float(torch.linalg.vector_norm(v))
    e = float(torch.linalg.vector_norm(y64 - v))
    return e / s if s > 0 else e


def split(dd, row: dict, o: torch.Tensor) -> tuple[str | None, float]:
    """(None, d) where the reference's grad_out record is its consumer's alone (d: its relative
    distance from o); (key, d) where o + the record `key` explains it (a residual path; d: the
    distance from that sum); ("", d) where nothing does (not judged)."""
    y_ref = dd.tensors[row["key"]][0]
    if tuple(o.shape) != tuple(y_ref.shape) or not (y_ref.is_floating_point() or y_ref.is_complex()):
        return None, 0.0
    o64 = o.to(torch.float64)
    d0 = _dist(y_ref, o64)
    tried = 0
    # nearest first: the add's output grad is made just before the consumer's backward runs
    for r in sorted(dd.rows, key=lambda r: -r["idx"]):
        if (r["kind"] != "grad_out" or r["phase"] != "backward" or r["step"] != row["step"]
                or r["idx"] >= row["idx"] or r["key"] not in dd.tensors):
            continue
        p = dd.tensors[r["key"]][0]
        if tuple(p.shape) != tuple(y_ref.shape) or p.dtype != y_ref.dtype:
            continue
        d = _dist(y_ref, o64 + p.to(torch.float64))
        if d * BETTER < d0:
            return r["key"], d
        tried += 1
        if tried >= CANDIDATES:
            break
    return (None, d0) if d0 <= NO_REFERENCE else ("", d0)


def attach(dd, row: dict, o: torch.Tensor) -> None:
    """dd.oracle's value for a grad_out record at the first divergence: its consumer's float64
    input grad, plus the other path's grad where split() finds one (bitwise equal at both sides:
    then one exact value for both); none, and the reason, where nothing explains the reference."""
    key, d = split(dd, row, o)
    if key == "":
        row["oracle_refused"] = UNEXPLAINED.format(d)
        return
    if key is not None:
        if not path_equal(dd, key):
            return  # that path's grad differs already: judged past the first divergence (oracle_own)
        row["other_path"] = key
        o = with_path(dd, key, o, 0)
    dd.oracle[row["key"]] = o


def with_path(dd, key: str, o: torch.Tensor, side: int) -> torch.Tensor:
    """o + the other path's grad as side `side` (0: the reference, 1: this side) recorded it."""
    return o.to(torch.float64) + dd.tensors[key][side].to(torch.float64)


def path_equal(dd, key: str) -> bool:
    """The other path's grad bitwise equal at both sides (o + p is then one exact value for both)."""
    a, b = dd.tensors[key]
    return a.shape == b.shape and bool(torch.equal(a, b))


def what(dd, key: str | None) -> str:
    """The words the verdict's model gets for the other path."""
    if not key:
        return ""
    m = next((r["module"] for r in dd.rows if r["key"] == key), key)
    return f" plus the grad through the residual add ({m}'s output grad)"
