"""The own-input pass's reference keeps, of a weight grad re-executed in float64 from another
world's inputs (oracle_hooks.record_own_oracles: `param_grad.SHORT.cCALL@LABEL`), only what the
diff reads of it: diff/oracle.judge_own reads that value o_N for two norms against that world's
own record y_N, ||o_N|| and ||y_N - o_N||, and whether o_N is finite. Where the second pass shipped
y_N beside that world's inputs (runner/drill_own.own_files, diff/own_inputs.side_records), the
world records SIDE = [||o_N||, ||y_N - o_N||, o_N finite, numel, y_N's hash as two 32-bit halves]
under `param_grad.SHORT~norms@LABEL` (float64, 48 bytes) instead of o_N: at llama-1b these grads
were 1.87 of the 2.04 GB that world wrote, each read back and hash-checked by the diff for two
norms. The hash ties the figures to the record the diff reads: another y_N (a shipped file not the
record's, an edited record) is refused there (diff/oracle_own.py), never judged.

Only a one-rank reference, a step in one piece and no decode prefix (as oracle_hooks.NORMS), and
only a parameter whose accumulated grad this world's probe sees (its calls are summed there, in
the order the diff summed their records). TPDIAG_OWN_SIDE_NORMS=0: nothing is shipped, o_N whole
(the old path, the A/B: tests/test_own_side_norms.py)."""
from __future__ import annotations

import os
import time

import torch

from tpdiag.records.keys import ORACLE_NORMS, record_key

# the figures' order in the record
S, E, FINITE, NUMEL, HASH_LO, HASH_HI = range(6)
WIDTH = 6


def enabled() -> bool:
    return os.environ.get("TPDIAG_OWN_SIDE_NORMS", "1") != "0"


def side_record(y: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """SIDE (the module doc) of o (float64, where it was computed) against y (the shipped record)."""
    from tpdiag.records.hashing import tensor_hash

    o = o.detach()
    yd = y.detach().to(o.device)
    h = int(tensor_hash(yd), 16)  # of y as the record holds it: its dtype and shape
    s = torch.linalg.vector_norm(o.to(torch.float64))
    e = torch.linalg.vector_norm(yd.to(torch.float64) - o.to(torch.float64))
    fin = torch.isfinite(o).all().to(torch.float64)
    rest = torch.tensor([float(o.numel()), float(h & 0xFFFFFFFF), float(h >> 32)], dtype=torch.float64)
    return torch.cat([torch.stack([s, e, fin]).cpu(), rest])


def wanted(rec, shipped: dict, step: int, name: str, short: str, t: torch.Tensor, hooked) -> torch.Tensor | None:
    """The shipped record y_N this weight grad's float64 value t is to be kept as SIDE against, or
    None (t is recorded whole)."""
    if not enabled() or rec.world != 1 or rec.piece is not None or rec.prefix is not None:
        return None
    if short not in (hooked or {}).get(name, ()):
        return None  # no accumulated-grad hook of this world would record it
    y = shipped.get(record_key(step, "backward", name, "param_grad", 0, short))
    if type(y) is not torch.Tensor or not y.is_floating_point() or t.is_complex() or not t.is_floating_point() \
            or tuple(y.shape) != tuple(t.shape):
        return None
    return y


def hold(pend: dict, rec, label: str, name: str, short: str, call: int, cls, t: torch.Tensor, y) -> None:
    pend.setdefault((rec.step, name, short), {}).setdefault(label, [y, []])[1].append((call, cls, t))


def flush(rec, pend: dict, name: str, short: str, cls) -> None:
    """The weight grad of (name, short) was accumulated: each label's pending float64 grads, summed
    over the calls in the order the diff sums their records, recorded as SIDE."""
    got = pend.pop((rec.step, name, short), None)
    for label, (y, calls) in (got or {}).items():
        t0 = time.perf_counter()
        o = calls[0][2]
        for _, _, t in calls[1:]:
            o = o + t
        with rec._paused():  # its norms and hash are no ops of the step
            side = side_record(y, o)  # ends on the host: the device's work is done
        rec.oracle_s += time.perf_counter() - t0  # the float64 re-execution's time (`float64_s`)
        rec.add("oracle", name, f"param_grad.{short}{ORACLE_NORMS}@{label}", side, phase="backward", cls=cls)
