"""The user's grad hooks a plan dropped (models/grad_hooks.py; world.json's hooks_dropped), named at
the weight's grad: the hook runs at the reference and not at this degree, so that grad differs by
the hook's whole effect - a BUG whatever its bound says. A layout bound or the float64
re-execution cannot see it (they run the module, not the user's hook: from TP=N's own inputs its
unhooked grad is exact), and a hook that halves the grad read as "a loss or grad divided by
another count" before, a clip as rounding only."""
from __future__ import annotations


def lost_at(ref_world: dict, other_world: dict) -> dict[str, list[str]]:
    """{parameter: hook names} dropped at this degree and not at the reference (a reference at
    TP > 1 whose plan dropped the same hooks runs without them too)."""
    ref = ref_world.get("hooks_dropped") or {}
    out = {}
    for name, hooks in (other_world.get("hooks_dropped") or captured_lost(ref_world, other_world)).items():
        left = [h for h in hooks if h not in (ref.get(name) or [])]
        if left:
            out[str(name)] = [str(h) for h in left]
    return out


def captured_lost(ref_world: dict, other_world: dict) -> dict[str, list[str]]:
    """Two captures (api/capture.py: param_hooks, dtensor_params): {parameter: the hook names the
    reference's parameter had that this side's DTensor parameter lacks}. The user's own
    parallelize_module ran before the capture, so no one saw the hook dropped; a parameter that is
    a DTensor at both sides (the reference ran the plan too) or a plain tensor here is left alone."""
    mine, theirs = other_world.get("param_hooks"), ref_world.get("param_hooks")
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return {}
    dt, ref_dt = set(other_world.get("dtensor_params") or ()), set(ref_world.get("dtensor_params") or ())
    out = {}
    for name, hooks in theirs.items():
        if name in dt and name not in ref_dt:
            left = [h for h in hooks if h not in (mine.get(name) or [])]
            if left:
                out[name] = left
    return out


def why(param: str, hooks: list[str], label: str) -> str:
    return (f"the grad hook{'s' if len(hooks) > 1 else ''} {', '.join(hooks)} registered on {param} before the "
            f"plan was applied run{'' if len(hooks) > 1 else 's'} at the reference and not at TP={label}: "
            "parallelize_module replaced the parameter with a new DTensor parameter, which the hook is not on, "
            "so this grad misses what the hook does to it (register the hook after the plan is applied, on "
            "the parameter the module then holds)")


def _param_of(row: dict) -> str:
    # the root's own parameter records under either root name ("(root)" above HF's `model` child)
    from tpdiag.records.keys import param_name

    return param_name(row["module"], row["name"])


def name(entry: dict, rows: list[dict], lost: dict[str, list[str]], label: str, effect) -> None:
    """A sharding-bug finding at the first divergent grad of each parameter whose hooks this degree
    lost (the first divergence settled the same where it is that grad). Hooks the reference saw
    change nothing (effect[param] False: world.json's hook_effect, models/grad_hooks.watch - a
    logger, a clip that did not act) and a grad still bitwise are no finding, only said
    (entry["hooks_dropped"], and hooks_idle for the former): a dropped observer changes no number,
    and the grad's own rounding at TP=N is no bug. A reference that did not record the effect
    (an older run) is read as changed where the grad differs (fail closed)."""
    from tpdiag.diff.judge import describe, settle

    entry["hooks_dropped"] = dict(sorted(lost.items()))
    effect = effect if isinstance(effect, dict) else {}
    idle = sorted(p for p in lost if effect.get(p) is False)
    if idle:
        entry["hooks_idle"] = idle
    fd = entry.get("first_divergence") or {}
    for param, hooks in sorted(lost.items()):
        if param in idle:
            continue
        row = next((r for r in rows if r["phase"] == "backward" and r["kind"] == "param_grad"
                    and _param_of(r) == param and not r["bitwise"]), None)
        if row is None:
            continue
        because = why(param, hooks, label)
        if fd.get("key") == row["key"]:
            settle(fd, dropped_hook=because)
        f = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
             "name": row["name"], "step": row["step"], "cause": None, "max_abs": row["max_abs"],
             "bound": row.get("bound"), "bound_ratio": row.get("bound_ratio"), "key": row["key"]}
        f = describe(row, f, dropped_hook=because)
        entry["findings"] = [g for g in entry["findings"] if g.get("key") != row["key"]]
        entry["findings"].insert(0, f)
        entry["status"] = "divergent"


def unnamed(label: str, entry, rows: list[dict], ref_world: dict, other_world: dict) -> str | None:
    """The gate's check (diff/recheck.verify): a grad whose hooks the plan dropped is a finding with a
    bug label, re-derived from the worlds' own world.json and the re-diffed rows, as `name` made it.
    The finding is no record beyond a bound (from TP=N's own inputs its unhooked grad is exact:
    diff.csv has it within), so the check of the findings against diff.csv could not see it deleted:
    grad_hook_plan.py:hook_build with the finding cut from summary.json and ops/summary.json passed
    `gate --allow rounding`, exit 0 (red team hred16). A hook hook_effect calls an observer is held to
    that by the grads themselves (_not_idle: the re-diffed rows' rel_l2)."""
    from tpdiag.records.causes import cause_class

    lost = lost_at(ref_world, other_world)
    if not lost:
        return None
    effect = ref_world.get("hook_effect")
    effect = effect if isinstance(effect, dict) else {}
    found = {f.get("key"): f for f in ((entry or {}).get("findings") or ()) if isinstance(f, dict)}
    for param, hooks in sorted(lost.items()):
        if effect.get(param) is False:
            why = _not_idle(label, param, hooks, rows)
            if why:
                return why
            continue  # an observer: said, no finding (name's rule)
        row = next((r for r in rows if r["phase"] == "backward" and r["kind"] == "param_grad"
                    and _param_of(r) == param and not r["bitwise"]), None)
        if row is None:
            continue
        f = found.get(row["key"])
        if f is None or cause_class(f.get("cause")) != "bug":
            return (f"summary.json's TP={label} findings lack {row['key']} as a bug: the grad of {param}, whose "
                    f"grad hook(s) {', '.join(hooks)} the plan dropped (world.json hooks_dropped), differs "
                    "(edited after the run)")
    return None


def _not_idle(label: str, param: str, hooks: list[str], rows: list[dict]) -> str | None:
    """hook_effect False says the dropped hooks changed no grad at the reference, so this degree, which
    ran without them, has the reference's grad up to rounding. Where that grad moved beyond what
    rounding moves a grad no check judged (diff/moved_limit.moved_beyond's limit, in the grad's own
    dtype) the hooks acted: hook_effect edited. Set false in TP=1's world.json (and the second pass's),
    with the finding cut from both summaries, grad_hook_plan.py:hook_build (the unclipped grad 3.8 times its
    norm away) passed `gate --allow rounding`, exit 0 (red team hred16). A grad with no such measure (one
    side non-finite): fail closed, the claim cannot be checked."""
    from tpdiag.diff.moved_limit import moved_limit

    mine = [r for r in rows if r["kind"] == "param_grad" and r["phase"] == "backward" and _param_of(r) == param]
    # its first step only: later steps start from weights the updates already moved apart (a bf16
    # grad moves ~0.1-0.24 of its norm by step 2 of a correct run: diff/moved_records.cut)
    first = min((int(r["step"]) for r in mine if str(r.get("step", "")).lstrip("-").isdigit()), default=None)
    for r in mine:
        if r["bitwise"] or (first is not None and str(r.get("step")) != str(first)):
            continue
        moved = r.get("rel_l2")
        limit = moved_limit([r.get("dtype")])
        if moved is None or not moved <= limit:
            what = "cannot be compared whole" if moved is None else f"moved {moved:.3g} of the reference's"
            return (f"the reference's world.json hook_effect calls the grad hook(s) {', '.join(hooks)} on {param} an "
                    f"observer, but TP={label}'s grad {r['key']}, which the plan left without them, {what} "
                    f"(rounding moves it at most {limit:.3g}): the hooks changed the grad (edited after the run)")
    return None


def _hooked(world: dict) -> set[str]:
    """The parameters a world's world.json says carried the user's grad hooks when its model was built:
    hook_effect's where no plan ran (TP=1), hooks_kept's and hooks_dropped's where one did."""
    out = set()
    for k in ("hook_effect", "hooks_dropped"):
        v = world.get(k)
        out |= {str(p) for p in v} if isinstance(v, dict) else set()
    kept = world.get("hooks_kept")
    return out | ({str(p) for p in kept} if isinstance(kept, list) else set())


def census(label: str, ref_world: dict, other_world: dict, rows: list[dict]) -> str | None:
    """A parameter the reference's world.json names as carrying the user's grad hooks (hook_effect at
    TP=1), recorded at both sides (a row of the diff), is at TP=N kept or dropped: world.json lists
    it in hooks_kept or hooks_dropped, else it was edited. hooks_dropped cut from TP=N's world.json
    (with the finding cut from the summaries) passed `gate --allow rounding` on
    grad_hook_plan.py:hook_build, exit 0 (red team hred16). One way only: a user's hand-written TP
    registers hooks of its own at TP > 1 (two_paths.py's all-reduce on the block's grads)."""
    ref, other = _hooked(ref_world), _hooked(other_world)
    both = {_param_of(r) for r in rows if r["kind"] in ("param_grad", "param", "param_init")}
    p = next(iter(sorted((ref - other) & both)), None)
    if p is None:
        return None
    return (f"the reference's world.json names the user's grad hooks on {p}, TP={label}'s neither as kept nor "
            "dropped (hook_effect; hooks_kept, hooks_dropped): a plan keeps or drops each (edited after the run)")
