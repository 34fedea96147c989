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
    return row["name"] if row["module"] == "model" else f"{row['module']}.{row['name']}"


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
