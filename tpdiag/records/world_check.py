"""A world of a run directory that manifest.json calls ok: are its own files (result.json, the per-rank
markers, world.json's settings, a second pass's every stored record) that world's, from inside the run
directory? records/integrity.py asks this of every world."""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.base.configs import folder
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import EVENTS, RESULT, TENSORS, WORLD, rank_marker, world_file
from tpdiag.records.sides import base_world_problem, settings_problem


def _outside(run_dir: str, d: str, label: str, who: str) -> str | None:
    """A world's own files are read only from inside the run directory: a file of tpN/ that is a
    symlink out of it (a copy of other records, another run's world) is refused, as a symlinked tpN
    is (records_dir)."""
    root = os.path.realpath(run_dir)
    for name in (EVENTS, TENSORS, WORLD, RESULT):
        p = os.path.join(d, name)
        if os.path.islink(p) and os.path.commonpath([os.path.realpath(p), root]) != root:
            return (f"{who}: {folder(label)}/{name} is a symlink out of the run directory (to "
                    f"{os.path.realpath(p)}); refused")
    return None


def _omitted_problem(manifest: dict, d: str, label: str, who: str) -> str | None:
    """Where world.json's logprob recipe or rerun folder is not manifest.json's, the default's keys left
    out on either side (config.RECIPE_OMITTED). The logprobs' rounding bound reads world.json's
    (diff/engine._recipe): a world.json edited to trainer_temperature 1e-9 moved a run's logprob bound
    from 6.6e-5 to 743 and `gate --allow rounding` passed it (red team hreview15; tests/test_recipe_tamper.py).
    A rerun's folder (pass_of: confirm/<fix>, auto/round<i>, variants/<slug>) edited out of its
    manifest.json alone, the rerun copied out of its run gated as the user's run (records/nested.py)."""
    from tpdiag.config import RECIPE_OMITTED

    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    try:
        world = io.read_json(world_file(d, WORLD))
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    wcfg = (world.get("config") if isinstance(world, dict) else None) or {}
    for k, default in {**RECIPE_OMITTED, "pass_of": ""}.items():
        if wcfg.get(k, default) != cfg.get(k, default):
            return (f"{who}: {folder(label)}/{WORLD} ran {k} {wcfg.get(k, default)!r} but manifest.json says "
                    f"{cfg.get(k, default)!r} (another run's records, or a file edited)")
    return None


def world_problem(run_dir: str, manifest: dict, label: str, degree, base: str | None = None,
                   layout: bool = False) -> str | None:
    """Why the records of a world the manifest calls ok cannot be trusted, or None. layout: also open
    its record set and check every stored record's dtype and shape against its index (a world nobody
    re-diffs: a second pass's)."""
    from tpdiag.records.rundir import records_dir

    who = f"reference rerun TP={label}" if label == base else f"TP={label}"
    try:
        d = records_dir(run_dir, manifest, label)
    except Inconclusive as e:
        return f"{who}: {e}"
    why = _outside(run_dir, d, label, who)
    if why:
        return why
    try:
        res = io.read_json(world_file(d, RESULT))
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    if not isinstance(res, dict) or res.get("status") != "ok":
        status = res.get("status") if isinstance(res, dict) else res
        return f"{who}: {folder(label)}/{RESULT} says {status!r} but manifest.json says ok"
    if str(res.get("label")) != label or res.get("degree") != degree:
        return f"{who}: {folder(label)}/{RESULT} is for TP={res.get('label')} (degree {res.get('degree')!r})"
    if type(degree) is not int or not 1 <= degree <= 1 << 16:
        return f"{who}: manifest.json degree {degree!r} is not a world size"
    try:
        errors = sorted(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(".error"))
    except OSError as e:
        return f"{who}: {folder(label)}/ unreadable ({e.strerror or e})"
    if errors:
        return f"{who}: {folder(label)}/{errors[0]} exists (a rank failed) but manifest.json says ok"
    from tpdiag.records.markers import undone

    gone = undone(d, degree)
    if gone:
        return f"{who}: {folder(label)}/{rank_marker(gone[0], 'done')} {gone[1]}"
    why = (settings_problem(manifest, d, label, who, degree) or _omitted_problem(manifest, d, label, who)
           or base_world_problem(run_dir, d, who, degree))
    if why or not layout:
        return why
    # The second pass's records are not re-diffed (its diff.csv is trusted as the first pass's is not),
    # but they are its float64 verdicts' evidence: a tensor file truncated by a crashed copy, another
    # world's events.jsonl or records.safetensors in their place, or a value edited inside the file is a
    # corrupt capture (DESIGN: exit 2), found from the index, the file's header and each record's stored
    # hash (its bytes read once, as the first pass's re-diff reads every record's).
    from tpdiag.records.store import RecordSet

    try:
        RecordSet(d).check_every_record()
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    return None
