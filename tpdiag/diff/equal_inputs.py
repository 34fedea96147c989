"""Whether a record's inputs were bitwise equal at both sides: every forward input of the call and
every parameter its module read (from step 1 on, the step before's update), or - for a weight
grad - those and every output grad of the step. Where they were, the reference's float64
re-execution is the exact value for both sides (diff/oracle.py)."""
from __future__ import annotations


def _index(dd) -> dict:
    """What inputs_equal and grads_equal look up, from one pass over the rows (they are asked
    for many records: a scan per record was quadratic in a large model's records)."""
    got = getattr(dd, "_equal_index", None)
    if got is not None and got["n"] == len(dd.rows):
        return got
    ix = {"n": len(dd.rows), "bad_in": set(), "calls": {}, "calls_out": {}, "bad_params": {}, "bad_buffers": {},
          "bad_grad_out": set()}
    from tpdiag.diff.anchored import steps as anchored_steps

    # a step re-anchored at the reference's state read the reference's weights, not the update before
    anchored = anchored_steps(dd.rows)
    for r in dd.rows:
        k, st, m = r["kind"], r["step"], r["module"]
        if k == "in" and r["phase"] == "forward":
            ix["calls"].setdefault((st, m), set()).add(r["call"])
            if not r["bitwise"]:
                ix["bad_in"].add((st, m, r["call"]))
        elif k == "out" and r["phase"] == "forward":
            ix["calls_out"].setdefault((st, m), set()).add(r["call"])  # diff/enclosing.calls
        elif k in ("param_init", "param", "buffer") and not r["bitwise"] and (k == "param_init" or st + 1 not in anchored):
            # the parameters a step's forward read: the init for step 0, else the step before's update
            # (a buffer the step before wrote is read as one)
            ix["bad_params"].setdefault(0 if k == "param_init" else st + 1, set()).add(m)
            if k == "buffer":
                ix["bad_buffers"].setdefault(st + 1, set()).add(m)
        elif k == "grad_out" and r["phase"] == "backward" and not r["bitwise"]:
            ix["bad_grad_out"].add((st, m))
    dd._equal_index = ix
    return ix


def inputs_equal(dd, row: dict) -> bool:
    """Every input of this call and every parameter of the module (and of its children) that
    the run recorded is bitwise equal: the oracle's value is the exact answer for both sides."""
    ix = _index(dd)
    m, step = row["module"], row["step"]
    if (step, m, row["call"]) in ix["bad_in"]:
        return False
    return params_equal(dd, m, step)


def params_equal(dd, module: str, step: int) -> bool:
    """Whether every recorded parameter of the module (and of its children) that step `step`'s
    forward read is bitwise equal at both sides: from step 1 on they are the step before's update,
    which at TP > 1 differs by its own rounding - the reference's module is then not this side's."""
    return not any(in_subtree(p, module) for p in _index(dd)["bad_params"].get(step, ()))


def in_subtree(owner: str, module: str) -> bool:
    """Whether the parameters recorded under `owner` are read by `module`'s forward: its own and its
    descendants'. The root's children are not named under "model." (they are "embed", "block"):
    every parameter is the root's - checked by name alone, the root's float64 backward at step 1
    ran from the reference's updated weights while this side's differed (by a bug's size after a
    broken update) and was read as this side's exact value. HF's root shared "model" with its
    child in format 2; in format 3 the root and its own parameters are "(root)" and "model" is that
    child, but a name alone does not say which layout a run has: "model" is taken as the root too (a
    stricter check, never a looser one)."""
    from tpdiag.records.keys import ROOTS

    return module in ROOTS or owner == module or owner.startswith(module + ".")


def side_params(dd, module: str, step: int) -> bool:
    """Whether `module`'s float64 re-execution from this side's own inputs (the own-input pass) ran
    the function this side computed: its subtree's parameters equal at both sides, or the reference
    world re-executed it from THIS side's parameters (shipped whole: diff/own_params.py; noted for
    each call, probes/oracle_hooks.record_own_oracles) and no buffer of its subtree differs (only
    parameters are swapped in)."""
    if params_equal(dd, module, step):
        return True
    ix = _index(dd)
    if any(in_subtree(b, module) for b in ix["bad_buffers"].get(step, ())):
        return False
    from tpdiag.records.keys import record_key

    notes = getattr(dd, "oracle_notes_own", None) or {}
    calls = ix["calls_out"].get((step, module)) or ix["calls"].get((step, module))
    return bool(calls) and all((notes.get(record_key(step, "forward", module, "oracle", c)) or {}).get("params")
                               == "this side's" for c in calls)


def grads_equal(dd, row: dict) -> bool:
    """A weight grad's module: its inputs, parameters and every output grad of the step equal."""
    ix = _index(dd)
    m, step = row["module"], row["step"]
    for c in ix["calls"].get((step, m)) or {0}:
        if not inputs_equal(dd, {"module": m, "step": step, "call": c}):
            return False
    return (step, m) not in ix["bad_grad_out"]
