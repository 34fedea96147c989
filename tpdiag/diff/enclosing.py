"""An output grad that leaves its module by plain code, judged by the enclosing module's float64
backward.

A grad_out record is the sum of its consumers' input grads. Where one module consumes it, that
module's float64 backward from this side's own inputs is its exact value (diff/oracle_own.py).
Where the output is read by code outside any module - `h = h * sigmoid(gate(h))` or a residual add
in the parent's forward - or by several modules, no one consumer makes it. The module whose forward
runs that code (the nearest called ancestor: the parent, or the root past a ModuleList) does: its
backward in float64, from this side's own inputs and output grad, passes through the child's output,
and the grad there is that record's exact value (probes/float64.module_oracle_grads' taps, recorded
as oracle records `grad_out.O.cJ.pP` of the child). Without it a replicated gate behind Megatron's f
(tests/models/planted/two_paths.py:gate_f: its input grad TP times) moved the block's output grad by
a quarter and read `rounding only`.

Judged only where the parent ran once in the step (its children's calls are then numbered as the
records number them) and every call of the child was inside it; otherwise not judged, with the reason
(diff/not_judged.py)."""
from __future__ import annotations

# the root's record name; HF's LlamaForCausalLM.model child is recorded as "model" too, so a
# top-level child's enclosing module is the root only where no module is named under "model."
ROOT = "model"


def called(dd) -> set[str]:
    """The modules with forward records in this diff (a container never called has none)."""
    got = getattr(dd, "_called", None)
    if got is None:
        got = {r["module"] for r in dd.rows if r["phase"] == "forward" and r["kind"] in ("in", "out")}
        try:
            dd._called = got
        except AttributeError:
            pass
    return got


def enclosing(module: str, modules: set[str]) -> str | None:
    """The nearest called ancestor of `module` (whose forward runs the code that reads its output),
    or None: the root itself, or a root whose name a child shares."""
    if module == ROOT:
        return None
    parts = module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        p = ".".join(parts[:i])
        if p in modules:
            return p
    if ROOT in modules and not any(m.startswith(ROOT + ".") for m in modules):
        return ROOT
    return None


def calls(dd, module: str, step) -> set:
    """The calls of `module` in `step` (its forward outputs' call indices), from the rows' one-pass
    index (a scan per grad_out row was quadratic in a large model's records)."""
    from tpdiag.diff.equal_inputs import _index

    return _index(dd)["calls_out"].get((step, module), set())


def tapped(dd, row: dict):
    """(the enclosing module, this side's float64 value, the reference's) for a grad_out row;
    (module or None, None, None) where there is none (why_not says why)."""
    parent = enclosing(row["module"], called(dd))
    if parent is None or len(calls(dd, parent, row["step"])) != 1:
        return parent, None, None
    mine = {k[2] for k in dd.grad_at_own if k[0] == row["step"] and k[1] == row["module"] and k[4] == 0}
    if len(mine) != len(calls(dd, row["module"], row["step"])):
        return parent, None, None  # a call of the child outside the parent: the numbering is not the records'
    k = (row["step"], row["module"], int(row["call"]), str(row["name"]), 0)
    return parent, dd.grad_at_own.get(k), dd.grad_at.get(k)


def why_not(dd, row: dict) -> str | None:
    """Why a grad_out with no one module consumer was not judged by its enclosing module; None where
    it should have been (the caller's reason stands)."""
    parent = enclosing(row["module"], called(dd))
    if parent is None:
        return ("the model's output, or read by the root's code where a child shares the root's name "
                "(no enclosing module to re-execute)")
    if len(calls(dd, parent, row["step"])) != 1:
        return f"read by the code of {parent}, called more than once in the step (its calls' children not told apart)"
    from tpdiag.records.keys import MalformedKey, RecordKey

    notes = getattr(dd, "oracle_notes", None) or {}
    for k, v in notes.items():
        try:
            p = RecordKey.parse(k)
        except MalformedKey:
            continue
        if (p.step, p.phase, p.module, p.kind) == (int(row["step"]), "backward", parent, "oracle") and v.get("why"):
            return f"read by the code of {parent}, whose float64 backward was refused: {v['why']}"
    outs = [r for r in dd.rows if r["module"] == parent and r["step"] == row["step"]
            and (r["phase"], r["kind"]) == ("forward", "out") and str(r.get("dtype", "")).startswith(("float", "bfloat"))]
    if len(outs) > 1:
        return (f"read by the code of {parent}, which returns {len(outs)} tensors (its float64 backward needs "
                "one differentiable output)")
    if not any(k[0] == row["step"] and k[1] == row["module"] for k in dd.grad_at_own):
        return f"read by the code of {parent}, which the own-input pass did not re-execute (not chosen, or over its budget)"
    return f"read by the code of {parent}, and outside it too (a call of it not inside {parent})"
