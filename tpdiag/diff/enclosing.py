"""An output grad that leaves its module by plain code, judged by the enclosing module's float64
backward.

A grad_out record is the sum of its consumers' input grads. Where one module consumes it, that
module's float64 backward from this side's own inputs is its exact value (diff/oracle_own.py).
Where the output is read by code outside any module - `h = h * sigmoid(gate(h))` or a residual add
in the parent's forward - or by several modules, no one consumer makes it. The module whose forward
runs that code (the nearest called ancestor: the parent, or the root past a ModuleList) does: its
backward in float64, from this side's own inputs and output grad, passes through the child's output,
and the grad there is that record's exact value (probes/float64.module_oracle_grads' taps, recorded
as oracle records `grad_out.O.cJ.pP.uK` of the child, the tapper K name levels up); so does any
ancestor's above it. Without it a replicated gate behind Megatron's f
(tests/models/planted/two_paths.py:gate_f: its input grad TP times) moved the block's output grad by
a quarter and read `rounding only`.

Judged by the nearest called ancestor that ran once in the step (its children's calls are then
numbered as the records number them, where every call of the child was inside it) and returns one
floating tensor (a float64 backward needs one differentiable output): past one that does not (a
stage returning its block's output and its gate's logits, two_paths:pair_f) the next one up, to
the root. Otherwise not judged, with the reason
(diff/not_judged.py)."""
from __future__ import annotations

# the root's record name: "model", or "(root)" where a child is named "model" (HF's
# LlamaForCausalLM.model, records/keys.ROOT_NAMESAKE; before RECORD_FORMAT 3 both were "model", two
# calls under one name, and the grads the child's code reads were never judged)
from tpdiag.records.keys import root_of


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


def ancestors(module: str, modules: set[str]) -> list[str]:
    """The called ancestors of `module`, nearest first, up to the root; [] for the root itself."""
    root = root_of(modules)
    if module == root:
        return []
    parts = module.split(".")
    out = [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in modules]
    if root in modules:
        out.append(root)
    return out


def enclosing(module: str, modules: set[str]) -> str | None:
    """The nearest called ancestor of `module` (whose forward runs the code that reads its output),
    or None: the root itself."""
    got = ancestors(module, modules)
    return got[0] if got else None


def outputs_index(rows) -> dict:
    """{(step, module): how many floating tensors it returned in a call (the most over its calls)},
    from the rows' forward outputs in one pass: a float64 backward is formed only through one."""
    per: dict = {}
    for r in rows:
        if (r["phase"], r["kind"]) == ("forward", "out") \
                and str(r.get("dtype", "")).replace("torch.", "").startswith(("float", "bfloat")):
            k = (r["step"], r["module"], r["call"])
            per[k] = per.get(k, 0) + 1
    out: dict = {}
    for (st, m, _), n in per.items():
        out[(st, m)] = max(out.get((st, m), 0), n)
    return out


def outputs(dd, step, module: str) -> int:
    """outputs_index for a diff's rows, built once a diff."""
    got = getattr(dd, "_outputs", None)
    if got is None or got[0] != len(dd.rows):
        got = (len(dd.rows), outputs_index(dd.rows))
        try:
            dd._outputs = got
        except AttributeError:
            pass
    return got[1].get((step, module), 0)


def judge(module: str, step, modules: set[str], calls_of, outputs_of) -> str | None:
    """The ancestor whose float64 backward judges the output grad of `module` read by code outside any
    module (or by several modules): the nearest called ancestor that ran once in the step and returns
    one floating tensor, up to the root (whose float64 backward starts at the logits' grad). A nearer
    one that returns several tensors (two_paths:pair_f's stage: its block and its gate's logits) forms
    no float64 backward; one called more than once does not tell its calls' children apart. None where
    no ancestor qualifies (why_not says why). calls_of(m): the calls of m in `step`; outputs_of(m): its
    floating outputs a call."""
    for a in ancestors(module, modules):
        if len(calls_of(a)) == 1 and outputs_of(a) <= 1:
            return a
    return None


def judge_of(dd, module: str, step) -> str | None:
    """judge() for a diff's rows, once per (step, module) a compare."""
    memo = getattr(dd, "_judge_of", None)
    if memo is None:
        memo = {}
        try:
            dd._judge_of = memo
        except AttributeError:
            pass
    k = (step, module)
    if k not in memo:
        memo[k] = judge(module, step, called(dd), lambda m: calls(dd, m, step), lambda m: outputs(dd, step, m))
    return memo[k]


def calls(dd, module: str, step) -> set:
    """The calls of `module` in `step` (its forward outputs' call indices), from the rows' one-pass
    index (a scan per grad_out row was quadratic in a large model's records)."""
    from tpdiag.diff.equal_inputs import _index

    return _index(dd)["calls_out"].get((step, module), set())


def tapper(dd, k: tuple) -> str | None:
    """The module whose float64 backward made the tapped grad keyed k (diff/engine.py: step, child,
    call, output, the tapper's call, the tapper; a record of a run before the tapper was named: the
    child's nearest called ancestor, the only one that tapped then)."""
    return k[5] if len(k) > 5 and k[5] is not None else enclosing(k[1], called(dd))


def _taps(dd) -> dict:
    """{(step, child, call, output, tapper): (this side's, the reference's)} of the tapper's call 0
    (a judging module runs once), and {(step, child, tapper): the child's calls tapped}: one pass
    over the tap records (a scan of them per grad_out row was quadratic in a large model's)."""
    got = getattr(dd, "_taps", None)
    if got is not None and got["n"] == (len(dd.grad_at_own), len(dd.grad_at)):
        return got
    got = {"n": (len(dd.grad_at_own), len(dd.grad_at)), "own": {}, "ref": {}, "calls": {}}
    for side, ks in (("own", dd.grad_at_own), ("ref", dd.grad_at)):
        for k, t in ks.items():
            if k[4] != 0:
                continue
            by = tapper(dd, k)
            got[side][(k[0], k[1], k[2], k[3], by)] = t
            if side == "own":
                got["calls"].setdefault((k[0], k[1], by), set()).add(k[2])
    try:
        dd._taps = got
    except AttributeError:
        pass
    return got


def tapped(dd, row: dict):
    """(the judging ancestor, this side's float64 value, the reference's) for a grad_out row;
    (the nearest called ancestor or None, None, None) where there is none (why_not says why)."""
    step, module = row["step"], row["module"]
    by = judge_of(dd, module, step)
    if by is None:
        return enclosing(module, called(dd)), None, None
    ix = _taps(dd)
    if len(ix["calls"].get((step, module, by), ())) != len(calls(dd, module, step)):
        return by, None, None  # a call of the child outside it: the numbering is not the records'
    k = (step, module, int(row["call"]), str(row["name"]), by)
    return by, ix["own"].get(k), ix["ref"].get(k)


def why_not(dd, row: dict) -> str | None:
    """Why a grad_out with no one module consumer was not judged by an enclosing module's float64
    backward; None where it should have been (the caller's reason stands)."""
    mods = called(dd)
    step = row["step"]
    chain = ancestors(row["module"], mods)
    if not chain:
        return "the model's output (no enclosing module to re-execute)"
    parent = chain[0]
    by = judge_of(dd, row["module"], step)
    if by is None:
        said = []
        for a in chain:
            n, o = len(calls(dd, a, step)), outputs(dd, step, a)
            said.append(f"{a} called {n} times in the step (its calls' children not told apart)" if n != 1 else
                        f"{a} returns {o} tensors (its float64 backward needs one differentiable output)")
        return f"read by the code of {parent}; no enclosing module runs once and returns one tensor: " + ", ".join(said)
    head = f"read by the code of {parent}" + (f", judged through {by}" if by != parent else "")
    from tpdiag.diff.equal_inputs import side_params

    refused = _refused(dd, by, step)
    if refused:
        return f"{head}, whose float64 backward was refused: {refused}"
    if not side_params(dd, by, step):
        # the reference's module on this side's inputs is not the function this side computed
        # (diff/oracle_own.apply_own): from step 1 on, each side's own update's rounding - unless
        # re-executed from this side's parameters, which were not shipped whole (hash-only records,
        # over the budget: diff/own_params.py) or a buffer of it differs too
        return (f"{head}, whose parameters differ at this step (each side's own update before it) and "
                "were not re-executed from this side's own")
    if not _taps(dd)["calls"].get((step, row["module"], by)):
        return f"{head}, which the own-input pass did not re-execute (not chosen, or over its budget)"
    return f"{head}, and outside it too (a call of it not inside {by})"


def _refused(dd, by: str, step) -> str | None:
    """Why `by`'s float64 re-execution was refused, the own-input pass's own note first (from this
    side's inputs: probes/oracle_hooks.record_own_oracles), else the reference's from its own; the
    backward's refusal, else its forward's (a forward refused never reaches its backward)."""
    for own in (True, False):
        first, by_step = _refusals(dd, own)
        for phase in ("backward", "forward"):
            v = first.get((int(step), phase, by))
            if v is not None:
                where = "from this side's own inputs, in the own-input pass" if own else "from the reference's inputs"
                inner = _refused_inside(by_step.get(int(step), ()), by, v["why"])
                return f"{v['why']} ({by}'s {phase} re-executed {where}" + \
                    (f"; refused inside it by {', '.join(inner)})" if inner else ")")
    return None


def _refusals(dd, own: bool) -> tuple[dict, dict]:
    """The refused re-executions among a diff's oracle notes (the own-input pass's, or the
    reference's), parsed once a diff: ({(step, phase, module): the first such note}, {step:
    [(module, why)]}) - a parse of every note per row asked was notes x rows."""
    notes = getattr(dd, "oracle_notes_own" if own else "oracle_notes", None) or {}
    attr = "_refusals_own" if own else "_refusals"
    got = getattr(dd, attr, None)
    if got is None or got[0] is not notes or got[1] != len(notes):
        from tpdiag.records.keys import MalformedKey, RecordKey

        first: dict = {}
        by_step: dict = {}
        for k, v in notes.items():
            try:
                p = RecordKey.parse(k)
            except MalformedKey:
                continue
            if p.kind != "oracle" or p.name is not None or not v.get("why"):
                continue
            first.setdefault((p.step, p.phase, p.module), v)
            by_step.setdefault(p.step, []).append((p.module, v["why"]))
        got = (notes, len(notes), first, by_step)
        try:
            setattr(dd, attr, got)
        except AttributeError:
            pass
    return got[2], got[3]


def _refused_inside(refused, by: str, why: str) -> list[str]:
    """The deepest modules inside `by` whose own re-execution was refused for the same reason at this
    step (refused: that step's (module, why) of _refusals; the dropout whose random draw refused the
    root's): where the reason comes from."""
    from tpdiag.diff.equal_inputs import in_subtree

    got = {m for m, w in refused if m != by and in_subtree(m, by) and w == why}
    return sorted(m for m in got if not any(o != m and o.startswith(m + ".") for o in got))
