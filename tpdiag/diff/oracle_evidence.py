"""A first divergence's float64 verdict must have its float64 re-execution on disk (red team hred13).

The second pass re-executes the first divergence's module in float64 on its reference world and writes
the result as records of kind `oracle` (probes/float64.py); its verdict (`oracle`: far or within rounding)
is copied into summary.json (runner/drill.py). The gate does not re-run the oracle (docs/security.md), but
it can see that its evidence is there: the second pass's records are read and hash-checked, not re-diffed,
so those `oracle` records removed from its reference's events.jsonl (with world.json's count) left a
"within rounding" verdict that stood on nothing - `gate --allow rounding` passed (exit 0).
"""
from __future__ import annotations

import os


def _modules(fd: dict) -> set[str]:
    """The modules whose float64 re-execution judges this record: its own, or, for an output grad, its sole
    consumer's (runner/drill.py picks those), or the caller that computed an input, or for a buffer the
    writer whose run judged it."""
    mods = {fd.get("module")}
    if isinstance(fd.get("oracle"), dict):
        mods.add(fd["oracle"].get("module"))  # a buffer judged by the module that wrote it (diff/oracle.py)
    mods |= {c for c in fd.get("consumers") or () if isinstance(c, str)}
    if isinstance(fd.get("made_in"), str):
        mods.add(fd["made_in"])
    return {m for m in mods if isinstance(m, str)}


def _from_logits(fd: dict) -> bool:
    """The grad of the logits judged against the float64 cross-entropy grad computed from the recorded
    logits and labels (diff/loss_grad.py): only a backward output grad no module consumed can be."""
    return (fd["oracle"].get("from") == "logits" and fd.get("phase") == "backward"
            and fd.get("kind") == "grad_out" and not fd.get("consumers"))


def problems(run_dir: str, summary: dict) -> list[str]:
    from tpdiag.errors import Inconclusive
    from tpdiag.records.axes import entries
    from tpdiag.records.paths import SECOND_PASS_DIRS
    from tpdiag.records.rundir import read_manifest, records_dir
    from tpdiag.records.store import read_index

    seen: dict = {}
    for lab, d in entries(summary).items():
        fd = d.get("first_divergence") if isinstance(d, dict) else None
        if not isinstance(fd, dict) or not isinstance(fd.get("oracle"), dict) or not fd.get("second_pass_dir"):
            continue
        if _from_logits(fd):
            continue  # diff/loss_grad.py: the logits' cross-entropy grad, computed from the records
        name = os.path.basename(str(fd["second_pass_dir"]).rstrip("/"))
        if name not in SECOND_PASS_DIRS:
            continue  # records/integrity.py names it
        if name not in seen:
            sub = os.path.join(run_dir, name)
            try:
                m = read_manifest(sub)
                ref = str(m.get("reference") or (m.get("labels") or [None])[0])
                _, events = read_index(records_dir(sub, m, ref))
            except (Inconclusive, KeyError, TypeError, AttributeError) as e:
                seen[name] = f"{name}/: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            else:
                seen[name] = {(ev.get("step"), ev.get("module")) for ev in events if ev.get("kind") == "oracle"}
        got = seen[name]
        if isinstance(got, str):
            return [f"summary.json's TP={lab} first divergence has a float64 verdict from the second pass in {got}"]
        if not any((fd.get("step"), mod) in got for mod in _modules(fd)):
            return [f"summary.json's TP={lab} first divergence {fd.get('key')} has a float64 verdict (far: "
                    f"{fd['oracle'].get('far')}), but the second pass's reference in {name}/ holds no float64 "
                    f"re-execution of {fd.get('module')} (its oracle records removed, or edited after the run)"]
    return []
