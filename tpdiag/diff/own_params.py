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
    """{record key of a parameter a step's forward read: this side's whole value}. A group's size is
    read from its records' shapes before any value is loaded: a large model's parameters past the
    budget are never assembled (at llama-1b the root's are 4.4 GB a step)."""
    from tpdiag.diff.equal_inputs import in_subtree
    from tpdiag.records.own_pass import nbytes
    from tpdiag.records.side_params import read_at
    from tpdiag.records.store import RecordSet

    ref, other = RecordSet(ref_dir), RecordSet(other_dir)
    ran = {(int(m["step"]), m["module"]) for m in other.events if m["phase"] == "forward"}
    by_step: dict = {}  # step read -> its parameter records
    from tpdiag.records.anchor import anchored_steps

    # a step re-anchored at the reference's state read the reference's parameters: none to ship
    anchored = anchored_steps(other.world)
    for om in other.events:
        if om["kind"] in ("param", "param_init") and read_at(om["step"], om["kind"]) not in anchored:
            by_step.setdefault(read_at(om["step"], om["kind"]), []).append(om)
    from tpdiag.diff.packed_shards import PackedShards

    packed = PackedShards()  # a hand-cut packed weight's layout, learned from its init (step 0 first)
    seen: dict = {}  # key -> (this side's whole value or None, differs)
    out, used = {}, 0
    for m in sorted(wanted):
        for step, recs in sorted(by_step.items()):
            mine = [om for om in recs if in_subtree(om["module"], m)]
            if (step, m) not in ran or not mine:
                continue
            size = sum(nbytes([int(d) for d in _shape(ref, om)], om.get("dtype")) for om in mine if om["key"] not in out)
            if used + size > budget:
                continue
            for om in mine:
                if om["key"] not in seen:
                    seen[om["key"]] = _whole(ref, other, om, packed)
            got = [seen[om["key"]] for om in mine]
            if not any(d for _, d in got) or any(b is None for b, _ in got):
                continue
            for om, (b, _) in zip(mine, got):
                if om["key"] not in out:
                    out[om["key"]] = b
                    used += b.numel() * b.element_size()
    return out


def _shape(ref, om: dict) -> list:
    """A parameter record's whole shape from the metadata alone: the reference's (TP=1: whole), else
    this side's full shape, else its local one."""
    rm = ref.by_key.get(om["key"]) or {}
    return om.get("full_shape") or rm.get("full_shape") or rm.get("local_shape") or om.get("local_shape") or ()


def _whole(ref, other, om: dict, packed=None) -> tuple:
    """(this side's whole value of a parameter record, whether it differs from the reference's), or
    (None, True) where there is no one whole value (hash-only, not one value across its ranks)."""
    from tpdiag.diff.pair_assemble import assemble_pair, pair_tensors
    from tpdiag.errors import NotComparable

    rm = ref.by_key.get(om["key"])
    if rm is None or "hash" in (om.get("stored"), rm.get("stored")):
        return None, True
    try:
        ra, oa = assemble_pair(rm, ref.tensor(rm), om, other.tensor(om))
        if packed is not None:
            oa = packed.regather(om, ra, oa)
        a, b = pair_tensors(ra, oa)
    except NotComparable:
        return None, True
    if oa.rank_consistent is False or not b.is_floating_point() or a.shape != b.shape:
        return None, True
    return b.contiguous(), not torch.equal(a, b)
