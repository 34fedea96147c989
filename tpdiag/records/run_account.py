"""What a run's own files say ran must be what its config ran: summary.json's account (the fixes,
steps, flags, configurations) and manifest.json's configurations against its config. An account
edited after the run describes another comparison than the one whose records are read. Only file
reads (records/ is the contract layer); records/sides.py checks whose records the worlds are.
"""
from __future__ import annotations


def what_ran_problems(manifest: dict, summary: dict) -> list[str]:
    """summary.json's account of what ran (the fixes, the steps - analyse.py copies them from the reference
    world) must be manifest.json's: a report or gate reader takes a fix-free bitwise verdict from it."""
    cfg = manifest.get("config")
    if not isinstance(cfg, dict):
        return []
    out = []
    if isinstance(cfg.get("fixes"), list) and "degrees" in summary and list(summary.get("fixes") or []) != cfg["fixes"]:
        out.append(f"summary.json says the fixes {list(summary.get('fixes') or [])!r} ran but manifest.json says "
                   f"{cfg['fixes']!r} (edited after the run)")
    if "steps" in summary and "steps" in cfg and summary["steps"] != cfg["steps"]:
        out.append(f"summary.json says {summary['steps']!r} steps ran but manifest.json says {cfg['steps']!r} "
                   "(edited after the run)")
    # the numerics flags are an axis of their own (DESIGN): the account of them must be the run's
    flags, worlds, labels = summary.get("flags"), manifest.get("worlds"), manifest.get("labels")
    if isinstance(flags, dict) and "flags" in cfg and flags.get("setting") != cfg["flags"]:
        out.append(f"summary.json says the flags {flags.get('setting')!r} ran but manifest.json says {cfg['flags']!r} "
                   "(edited after the run)")
    elif isinstance(flags, dict) and isinstance(worlds, dict) and isinstance(labels, list) and labels:
        ref = worlds.get(str(labels[0]))
        numerics = ref.get("numerics") if isinstance(ref, dict) else None
        if isinstance(numerics, dict) and "flag_values" in numerics and flags.get("values") != numerics["flag_values"]:
            out.append("summary.json's flag values are not the ones manifest.json's reference world recorded "
                       "(edited after the run)")
    # a forward-only account of a run that ran backward reads its backward records as never compared
    if "backward" in summary and "backward" in cfg and summary["backward"] is not cfg["backward"]:
        out.append(f"summary.json says backward {summary['backward']!r} but manifest.json says {cfg['backward']!r} "
                   "(edited after the run)")
    # what each configuration is (its TP, micro-batch, mode): the report and the CLI say "decode vs
    # prefill" from these, so a decode configuration relabelled prefill would describe another comparison
    confs = manifest.get("configurations")
    from tpdiag.records.axes import entries

    for lab, d in entries(summary).items() if isinstance(confs, dict) else ():
        want = confs.get(lab)
        if not isinstance(d, dict) or "config" not in d or not isinstance(want, dict):
            continue
        point = {k: v for k, v in want.items() if k != "axis"}
        if d["config"] != point or ("axis" in d and d["axis"] != want.get("axis")):
            out.append(f"summary.json says TP={lab} is {d['config']!r} (axis {d.get('axis')!r}) but manifest.json "
                       f"says {point!r} (axis {want.get('axis')!r}) (edited after the run)")
    return out


def labels_problem(manifest: dict) -> str | None:
    """manifest.json's configurations must be the ones its own config runs: a configuration cut from the
    labels, the worlds, summary.json and diff.csv together (its folder removed) - one degree of three,
    a micro-batch or decode configuration - is a run that compared less than it was asked to."""
    cfg, labels = manifest.get("config"), manifest.get("labels")
    if not isinstance(cfg, dict) or not isinstance(labels, list):
        return None  # integrity.problems says a compare's manifest lists no labels
    from tpdiag.config import CompareConfig
    from tpdiag.errors import BadInput

    try:
        want = [w.label for w in CompareConfig.from_dict(cfg).worlds()]
    except (BadInput, TypeError, ValueError, KeyError, AttributeError) as e:
        return f"manifest.json's config is not one this tpdiag runs ({str(e).splitlines()[0][:200] if str(e) else e!r})"
    if [str(x) for x in labels] != want:
        return (f"manifest.json lists the configurations {', '.join(map(str, labels))} but its config runs "
                f"{', '.join(want)} (a configuration removed, or edited after the run)")
    confs = manifest.get("configurations")
    if isinstance(confs, dict):
        from tpdiag.base.points import recorded_axes

        worlds = CompareConfig.from_dict(cfg).worlds()
        shown = recorded_axes(worlds)
        for w in worlds:
            point = {**w.point.to_dict(shown), "axis": w.axis}
            if confs.get(w.label) != point:
                return (f"manifest.json says the configuration {w.label} is {confs.get(w.label)!r} but its config "
                        f"runs {point!r} (edited after the run)")
    degs = manifest.get("degrees")
    if isinstance(degs, list) and isinstance(cfg.get("degrees"), list) and degs != cfg["degrees"]:
        return f"manifest.json says the degrees {degs!r} but its own config says {cfg['degrees']!r} (edited after the run)"
    return None
