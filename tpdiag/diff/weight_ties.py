"""A weight tie the plan split at a degree (models/ties.py), named at its first parameter's weight
grad (diff/analyse.py)."""
from __future__ import annotations

from tpdiag.diff.judge import describe


def broken_ties(entry: dict, rows: list[dict], broken: list, label: str, hint: str = "") -> None:
    """A weight the reference shares between modules that this degree's plan split into separate
    parameters (models/ties.py): a sharding bug at the first such parameter's weight grad - its
    grad holds only its own module's uses - whatever its numbers' bound says."""
    for group in broken:
        names = [str(n) for n in group if isinstance(n, str)]
        row = next((r for r in rows for n in names if r["phase"] == "backward" and r["kind"] == "param_grad"
                    and f"{r['module']}.{r['name']}" == n), None)
        if row is None:
            continue
        f = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
             "name": row["name"], "step": row["step"], "cause": None, "max_abs": row["max_abs"],
             "bound": row.get("bound"), "bound_ratio": row.get("bound_ratio"), "key": row["key"],
             "detail": f"the plan split the weight tie {' = '.join(names)} into {len(names)} parameters at "
                       f"TP={label}: each gets only its own module's grad (the reference sums every use "
                       "into one) and they are trained apart from the first optimizer step" + hint}
        f["split_tie"] = names
        f = describe(row, f, broken_tie=True)
        entry["findings"] = [g for g in entry["findings"] if g.get("key") != row["key"]]
        entry["findings"].insert(0, f)
        entry["status"] = "divergent"


def split_pairs(a: dict, b: dict) -> list[list[str]]:
    """[first, alias] for each weight capture `a` ties (fingerprint `tied`) that is two weights of
    their own in capture `b`."""
    tied = a["model"]["fingerprint"].get("tied") or {}
    own = b["model"]["fingerprint"]["params"]
    return [[first, alias] for alias, first in tied.items() if alias in own and first in own]


def lost_ties(a: dict, b: dict) -> list[list[str]]:
    """The ties of the reference capture `a` that are weights of their own in `b` ([first, alias]
    each), where that is the only difference of their parameter names: a plan that split a tie at
    b's degree. The shared names' records compare as usual - the first's weight grad at b lacks the
    alias's uses - so the diff names it there (broken_ties) instead of refusing the pair (diff/runs.py)."""
    tied = a["model"]["fingerprint"].get("tied") or {}
    own = b["model"]["fingerprint"]["params"]
    names = list(a["model"]["fingerprint"]["params"])
    split = split_pairs(a, b)
    aliases = {alias for _, alias in split}
    kept = b["model"]["fingerprint"].get("tied") or {}
    if not split or [n for n in own if n not in aliases] != names or any(tied.get(k) != v for k, v in kept.items()):
        return []
    return split


def split_of(ref_dir: str, other_dir: str) -> list[list[str]] | None:
    """The ties a diff of two captures names split (lost_ties), re-derived from their
    manifests for the gate (diff/recheck.py); None where either is no capture (a compare world)."""
    import os

    from tpdiag.records.paths import RunDir

    if not all(os.path.isfile(RunDir(d).manifest) for d in (ref_dir, other_dir)):
        return None
    from tpdiag.base import files as io

    try:
        a, b = (io.read_json(RunDir(d).manifest) for d in (ref_dir, other_dir))
        if not all(m.get("tool") == "tpdiag.capture" for m in (a, b)):
            return None
        return lost_ties(a, b) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not a capture manifest: the diff refused it, nothing to re-derive
