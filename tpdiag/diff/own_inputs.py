"""Each module judged on its own inputs: which divergent modules beyond the first divergence the
second pass re-executes in float64 from THIS side's recorded inputs (and output grad), and those
inputs, assembled whole from the first pass's records.

Why: past the first divergence every record's inputs already differ by the rounding that entered
there, so the reference's float64 re-execution (from the reference's inputs) is no exact value
for this side; a wrong function computed later (a weight grad averaged instead of summed, a loss
scaled by the degree) then reads as "inherits the earlier rounding". The reference's module -
the function TP=1 computes - re-run in float64 on this side's own inputs is the exact value this
side should have produced from what it was given: far from it is a bug wherever it sits
(diff/oracle.py, judge_own).

Budget: every such module while there are at most MAX_ALL and their inputs and output grads fit
in BUDGET_BYTES; past that, those whose output moved most beyond what their inputs explain
(relative difference of the output over the input's; a weight grad first), since a reordering
passes its input's difference through at about the same size.

After a hash-only first pass (a large model's default capture) there are no values to ship:
`hash_modules` picks the same kind of modules by the hashed records' norms and sizes, the region
pass captures them whole, and the modules chosen from ITS records (`modules`) are judged in one
more pass (runner/drill.py).
"""
from __future__ import annotations

import torch

from tpdiag.diff import enclosing, partials
from tpdiag.records.keys import ROOTS, RecordKey, record_key, sole_consumer
# the budget and kinds are the records' (records/own_pass.py reads a run's choice back with them)
from tpdiag.records.own_pass import OWN_BUDGET_BYTES as BUDGET_BYTES, OWN_KINDS as _KINDS, nbytes

MAX_ALL = 64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    s = float(torch.linalg.vector_norm(a))
    return float(torch.linalg.vector_norm(b - a)) / s if s > 0 else 0.0


def _growth(dd, r: dict) -> float:
    """_growth_of, once per compare for the same checked pairs (diff/pair_memo.py): the own-input
    pass's diff reads the region pass's records again and picks its modules from the same numbers
    (llama-1b 2 layers 1 x 128 on 2 CPU cores: 12 s of float64 norms over the two diffs)."""
    from tpdiag.diff import pair_memo

    ik = record_key(r["step"], "forward", r["module"], "in", r["call"], 0) if r["kind"] == "out" else None
    ids = pair_memo.of(dd, r["key"])
    if ids is not None and ik is not None and ik in dd.tensors:
        more = pair_memo.of(dd, ik)
        ids = ids + more if more is not None else None
    elif ids is not None:
        ids = ids + (None,)  # no input pair: the output's growth alone
    return pair_memo.cached(ids and ("growth", _growth_of, ids), lambda: _growth_of(dd, r))


def _growth_of(dd, r: dict) -> float:
    from tpdiag.diff import on_device

    inp = dd.tensors.get(record_key(r["step"], "forward", r["module"], "in", r["call"], 0)) if r["kind"] == "out" else None
    out = dd.tensors.get(r["key"])
    if out is None:
        return 0.0

    def rel(pair):  # float64 norms on the parent's check device where it has one: an order, not a verdict
        return on_device.run(_rel, *pair)
    ri = rel(inp) if inp is not None and inp[0].shape == inp[1].shape and inp[0].is_floating_point() else 0.0
    ro = rel(out) if out[0].is_floating_point() else 0.0
    return ro / ri if ri > 0 else (float("inf") if ro > 0 else 0.0)


def modules(dd, first_key: str | None) -> list[str]:
    """The modules of divergent forward outputs and weight grads (and the one consumer of a
    divergent grad_out) that the reference's own float64 run cannot judge: past the first
    divergence, not yet judged, with whole values at both sides."""
    cands: dict[str, float] = {}
    # a module whose input or output grad is each rank's unreduced share at this degree (MLA's
    # kv_a_proj: the rope columns' grad, all-reduced later by its style's own backward) has no
    # one value of this side to re-execute from: from one rank's share its weight grad came out
    # half of what the ranks reduce to, a false BUG at the zoo's dots3 (TP=2)
    partial = {u["module"] for u in getattr(dd, "uncompared", ()) or ()
               if u.get("kind") in ("in", "grad_out") and partials.unreduced(u)}
    for r in dd.rows:
        if r["bitwise"] or r.get("rank_consistent") is False or r.get("hash_only") or r.get("nonfinite_mismatch"):
            continue
        if r["key"] == first_key or r.get("oracle") or r["key"] not in dd.tensors:
            continue
        m = r["module"]
        if m in partial or (r["kind"] == "grad_out" and sole_consumer(r.get("consumers")) in partial):
            continue
        if (r["phase"], r["kind"]) in _KINDS and m not in ROOTS:
            cands[m] = max(cands.get(m, 0.0), _growth(dd, r))
        elif r["phase"] == "backward" and r["kind"] == "grad_out" and sole_consumer(r.get("consumers")):
            c = sole_consumer(r["consumers"])
            if c not in ROOTS:
                cands.setdefault(c, 0.0)
        elif r["phase"] == "backward" and r["kind"] == "grad_out":
            # no one module consumer: the ancestor whose float64 backward judges it (diff/enclosing.py;
            # called once in the step - HF's root and its `model` child shared one name in format 2:
            # two calls, never re-executed as one - and returning one tensor)
            outer = enclosing.judge_of(dd, m, r["step"])
            if outer is not None and outer not in partial:
                cands.setdefault(outer, 0.0)
    order = sorted(cands, key=lambda m: (-cands[m], m))[:MAX_ALL]
    size: dict[str, int] = {}
    for k, (_, b) in dd.tensors.items():
        rk = RecordKey.parse(k)
        if rk.kind in ("in", "grad_out") and rk.module in cands:
            size[rk.module] = size.get(rk.module, 0) + b.numel() * b.element_size()
    out, used = [], 0
    for m in order:
        if used + size.get(m, 0) > BUDGET_BYTES:
            continue
        used += size.get(m, 0)
        out.append(m)
    return sorted(out)


def taps(dd, chosen) -> list[str]:
    """The children whose output grads the chosen modules' float64 backwards must tap
    (probes/float64_taps.py): those with a divergent grad_out record that no one module consumes,
    read by the code of a chosen module (diff/enclosing.tapped judges them, nothing else reads a
    tap). Every other child's tap was recorded and never read: tiny-llama at TP=2 recorded 208
    oracle records in the own-input pass's reference, 200 with these only (its norms' output grads
    have one consumer each). Wider than the judgement on purpose (the first divergence's row too,
    judged or not)."""
    chosen, out = set(chosen), set()
    for r in dd.rows:
        if (r["phase"], r["kind"]) != ("backward", "grad_out") or r["bitwise"] or r["module"] in out \
                or sole_consumer(r.get("consumers")) is not None:
            continue
        # the module that judges it (diff/enclosing.judge: the next ancestor that runs once and
        # returns one tensor) - the one whose float64 backward must tap it
        if enclosing.judge_of(dd, r["module"], r["step"]) in chosen:
            out.add(r["module"])
    return sorted(out)


def side_inputs(ref_dir: str, other_dir: str, wanted: set[str], grads: bool = False) -> dict[str, torch.Tensor]:
    """{record key: this side's whole tensor} for the forward inputs and output grads of the
    `wanted` modules, assembled as the diff assembles them (shards joined, replicas checked).
    grads: their weight grads too - the records the reference's world takes the norms of its
    float64 weight grads against (probes/own_side_norms.py), assembled as diff/engine.py does (diff/pair_assemble.py)."""
    from tpdiag.diff.pair_assemble import assemble_pair, pair_tensors
    from tpdiag.errors import NotComparable
    from tpdiag.records.layout import first_positions, vocab_padded
    from tpdiag.records.store import RecordSet

    ref, other = RecordSet(ref_dir), RecordSet(other_dir)
    kinds = (("forward", "in"), ("backward", "grad_out")) + ((("backward", "param_grad"),) if grads else ())
    out = {}
    for om in other.events:
        if om["module"] not in wanted or om.get("stored") == "hash":
            continue
        if (om["phase"], om["kind"]) not in kinds:
            continue
        rm = ref.by_key.get(om["key"])
        if rm is None or rm.get("stored") == "hash":
            continue
        try:
            rt, ot = ref.tensor(rm), other.tensor(om)
            padded = vocab_padded(rm, rt, om, ot, ref.world.get("vocab_padding"), other.world.get("vocab_padding")) \
                if om["kind"] == "param_grad" else None
            ra, oa = padded or assemble_pair(rm, rt, om, ot)
            a, b = pair_tensors(ra, oa)
        except NotComparable:
            continue
        if oa.rank_consistent is False or first_positions(a, b, om.get("positions")).shape != b.shape \
                or not b.is_floating_point():
            continue  # no one value of this side to re-execute from
        out[om["key"]] = b.contiguous()
    return out


def _nbytes(r: dict) -> int:
    return nbytes([int(d) for d in r.get("shape") or ()], r.get("dtype"))


def hash_modules(dd, first_key: str | None) -> list[str]:
    """After a hash-only first pass: the modules `modules` would judge, chosen from the hashed
    records (the relative change of each record's norm stands in for its values' difference), for
    the region pass to capture whole. Within MAX_ALL and BUDGET_BYTES of their inputs, outputs and
    grads (one side)."""
    rows = dd.rows
    by_key = {r["key"]: r for r in rows}
    called = {r["module"] for r in rows if r["phase"] == "forward" and r["kind"] in ("in", "out")}
    cands: dict[str, float] = {}
    for r in rows:
        if r["bitwise"] or r.get("rank_consistent") is False or r.get("nonfinite_mismatch") or not r.get("hash_only"):
            continue
        if r["key"] == first_key or r.get("oracle"):
            continue
        m = r["module"]
        if (r["phase"], r["kind"]) == ("backward", "param_grad") and m not in ROOTS:
            cands[m] = float("inf")  # a weight grad first, as `modules` ranks them
        elif (r["phase"], r["kind"]) == ("forward", "out") and m not in ROOTS:
            src = by_key.get(RecordKey(r["step"], "forward", m, "in", r["call"], "0").format())
            ri = 0.0 if src is None or src["bitwise"] else (src.get("norm_rel_diff") or 0.0)
            ro = r.get("norm_rel_diff") or 0.0
            cands[m] = max(cands.get(m, 0.0), ro / ri if ri > 0 else (float("inf") if ro > 0 else 0.0))
        elif r["phase"] == "backward" and r["kind"] == "grad_out" and sole_consumer(r.get("consumers")):
            c = sole_consumer(r["consumers"])
            if c not in ROOTS:
                cands.setdefault(c, 0.0)
        elif r["phase"] == "backward" and r["kind"] == "grad_out":
            # no one module consumer: diff/enclosing.py (its indexes of the diff's rows, built once a
            # diff, not a scan a row)
            st = r["step"]
            outer = enclosing.judge(m, st, called, lambda a, st=st: enclosing.calls(dd, a, st),
                                    lambda a, st=st: enclosing.outputs(dd, st, a))
            if outer is not None:
                cands.setdefault(outer, 0.0)
    size: dict[str, int] = {}
    for r in rows:
        if r["module"] in cands and r["kind"] in ("in", "out", "grad_out", "param_grad"):
            size[r["module"]] = size.get(r["module"], 0) + _nbytes(r)
    out, used = [], 0
    for m in sorted(cands, key=lambda m: (-cands[m], m))[:MAX_ALL]:
        if used + size.get(m, 0) > BUDGET_BYTES:
            continue
        used += size.get(m, 0)
        out.append(m)
    return sorted(out)
