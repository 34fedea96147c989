"""This side's own parameters for the own-input pass (runner/drill_own.own_files): the reference's
module re-executed in float64 on this side's inputs is this side's function only where its subtree's
parameters are this side's too. From step 1 on they are each side's own update's - by rounding at
TP > 1, by a bug's size after a broken update - so for each chosen module and each step at which a
parameter of its subtree differs, EVERY parameter of that subtree is shipped, whole (the reference
world swaps in all of them or none: probes/own_params.py), keyed where the step's forward read it
(records/side_params.py). Within OWN_BUDGET_BYTES; past it, or where one is not whole (hash-only,
not one value across ranks), that module at that step is left to the reference's parameters and
the diff says not judged (diff/equal_inputs.side_params)."""
from __future__ import annotations

import torch

from tpdiag.records.own_pass import OWN_BUDGET_BYTES


def side_params(ref_dir: str, other_dir: str, wanted: set[str], budget: int = OWN_BUDGET_BYTES) -> dict:
    """{record key of a parameter a step's forward read: this side's whole value}."""
    from tpdiag.diff.engine import _assemble_pair, _pair_tensors
    from tpdiag.diff.equal_inputs import in_subtree
    from tpdiag.errors import NotComparable
    from tpdiag.records.side_params import read_at
    from tpdiag.records.store import RecordSet

    ref, other = RecordSet(ref_dir), RecordSet(other_dir)
    ran = {(int(m["step"]), m["module"]) for m in other.events if m["phase"] == "forward"}
    by_step: dict = {}  # step read -> [(meta, whole value or None, differs)]
    for om in other.events:
        if om["kind"] not in ("param", "param_init"):
            continue
        rm = ref.by_key.get(om["key"])
        b, differs = None, True
        if rm is not None and "hash" not in (om.get("stored"), rm.get("stored")):
            try:
                ra, oa = _assemble_pair(rm, ref.tensor(rm), om, other.tensor(om))
                a, b = _pair_tensors(ra, oa)
                if oa.rank_consistent is False or not b.is_floating_point() or a.shape != b.shape:
                    b = None
                else:
                    differs = not torch.equal(a, b)
            except NotComparable:
                b = None
        by_step.setdefault(read_at(om["step"], om["kind"]), []).append((om, b, differs))
    out, used = {}, 0
    for m in sorted(wanted):
        for step, recs in sorted(by_step.items()):
            if (step, m) not in ran:
                continue
            mine = [(om, b, d) for om, b, d in recs if in_subtree(om["module"], m)]
            if not any(d for _, _, d in mine) or any(b is None for _, b, _ in mine):
                continue
            fresh = [(om["key"], b) for om, b, _ in mine if om["key"] not in out]
            size = sum(b.numel() * b.element_size() for _, b in fresh)
            if used + size > budget:
                continue
            used += size
            out.update((k, b.contiguous()) for k, b in fresh)
    return out
