"""Whether the own-input pass after a hash-first region pass (region/ops/, runner/drill.py) ran, so that
its folder and summary.json must be there (records/integrity.py reads this)."""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive
from tpdiag.records.keys import ROOTS
from tpdiag.records.sides import started


def own_pass_wanted(sp: dict, region: dict, judge_downstream=None) -> bool:
    """Whether runner/drill.py ran the own-input pass after a hash-first region pass: with a confirmation,
    for the modules the confirming fix left divergent (summary.json's second_pass.own_after_confirm), else
    for every module the region pass left to judge (_judge_own_after_hash) - never under
    --no-judge-downstream (the run's manifest: judge_downstream false), whose region pass still lists
    them (an honest `compare --capture hash --no-judge-downstream` gated INCONCLUSIVE, exit 2)."""
    from tpdiag.records.axes import entries

    if judge_downstream is False:
        return False
    late = sp.get("own_after_confirm")
    if isinstance(late, dict):
        return any(late.values())
    return region.get("status") == "divergent" and any(
        isinstance(d, dict) and d.get("own_inputs") for d in entries(region).values())


def ran_here(run_dir: str, nested: str) -> str | None:
    """One line when the pass in `nested` is this run's (started after it) but has no summary.json."""
    from tpdiag.records.rundir import RunDir, read_manifest

    try:
        mine, theirs = started(read_manifest(run_dir)), started(read_manifest(os.path.join(run_dir, nested)))
    except Inconclusive:
        mine = theirs = None  # unreadable: not proven an earlier run's
    if mine is not None and theirs is not None and theirs < mine:
        return None
    return (f"the second pass's own-input pass {nested}/ ran (its manifest.json is there) but its summary.json is "
            f"missing: {RunDir(os.path.join(run_dir, nested)).summary} (deleted, or the run was cut short)")


# the records the own-input pass judges a module by (diff/own_inputs.py chooses with them too)
OWN_KINDS = (("forward", "out"), ("backward", "param_grad"))
# the inputs and output grads shipped to the second pass's reference (a file it loads whole):
# modules past this many bytes, in the order chosen, are left to the layout bounds
OWN_BUDGET_BYTES = 1 << 30
_BYTES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2}


def nbytes(dims, dtype) -> int:
    """Bytes of a record of these dims (ints) and dtype name ("torch." or not; 4 where unknown)."""
    n = 1
    for d in dims:
        n *= d
    return n * _BYTES.get(str(dtype or "").replace("torch.", ""), 4)


def _nbytes(r: dict) -> int:
    """A diff.csv row's (its shape written "AxB")."""
    return nbytes([int(d) if d.isdigit() else 1 for d in str(r.get("shape") or "").split("x")], r.get("dtype"))


def _left_in_rows(rows: list[dict], first_key, events: dict, ref_events: dict) -> list[str]:
    """The modules diff/own_inputs.modules cannot fail to choose, read from the pass's diff.csv and its
    world's index alone: a divergent forward output or weight grad past the first divergence, consistent
    across ranks, finite, with whole values at both sides. Leaner than `modules` on purpose (it has the
    tensors; here a module any of whose inputs or output grads went uncompared - an unreduced partial
    is one - is left out), so a module named here was chosen by it."""
    keys = {r["key"] for r in rows}
    uncompared = {m.get("module") for m in events.values() if m.get("kind") in ("in", "grad_out") and m.get("key") not in keys}
    size: dict[str, int] = {}
    for r in rows:
        if r["kind"] in ("in", "grad_out"):
            size[r["module"]] = size.get(r["module"], 0) + _nbytes(r)
    out = set()
    for r in rows:
        if r["bitwise"] is not False or r.get("rank_consistent") is not True or r["key"] == first_key:
            continue
        if (r["phase"], r["kind"]) not in OWN_KINDS or r["module"] in (*ROOTS, *uncompared):
            continue
        m, rm = events.get(r["key"]) or {}, ref_events.get(r["key"]) or {}
        if m.get("stored") in (None, "hash") or rm.get("stored") in (None, "hash") \
                or not isinstance(r.get("max_abs"), float) \
                or r["max_abs"] != r["max_abs"] or r["max_abs"] in (float("inf"), float("-inf")):
            continue  # hashed (no values to re-execute from) or non-finite
        if size.get(r["module"], 0) <= OWN_BUDGET_BYTES:
            out.add(r["module"])
    return sorted(out)


def own_pass_left(run_dir: str, name: str, region: dict, judge_downstream) -> str | None:
    """One line when the region pass's own records (its diff.csv, its worlds' index) leave modules to
    judge on their own inputs at a configuration whose entry in its summary.json names none: the
    own-input pass, deleted together with the summary's list of what it was for, dropped a bug judged on
    its own inputs unseen (red team hred11: a rounding-only run passed `gate --allow rounding`)."""
    from tpdiag.records.axes import entries
    from tpdiag.records.paths import RunDir
    from tpdiag.records.rundir import read_rows
    from tpdiag.records.store import read_index

    if judge_downstream is False or region.get("status") != "divergent":
        return None
    rows, ref = None, None
    for lab, d in entries(region).items():
        if not isinstance(d, dict) or d.get("own_inputs") or d.get("status") != "divergent":
            continue
        if rows is None:
            rows = read_rows(RunDir(os.path.join(run_dir, name)).diff_csv)
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else {}
        if ref is None:
            _, below = read_index(RunDir(os.path.join(run_dir, name)).world(str(region.get("reference_label"))))
            ref = {m["key"]: m for m in below}
        _, events = read_index(RunDir(os.path.join(run_dir, name)).world(lab))
        left = _left_in_rows([r for r in rows if r.get("degree") == lab], fd.get("key"),
                             {m["key"]: m for m in events}, ref)
        if left:
            return (f"{name}/summary.json's TP={lab} names no module to judge on its own inputs, but its diff.csv "
                    f"and records leave {len(left)} ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}) and "
                    f"the own-input pass {name}/ops/ is missing (edited after the run, or cut short)")
    return None
