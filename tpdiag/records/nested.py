"""Is a directory one of a run's own passes, not a run of its own? The second pass (ops/, region/
...), a confirmation's rerun (confirm/<fix>/), a fix chain's round (auto/round<i>/) and a matrix
variant (variants/<slug>/) are whole run directories by their files (records/paths.py), but each
is a part of its run's verdict: the second pass re-ran a few modules in float64, a confirmation
or a round ran the model with a fix the user did not choose, a variant had no second pass. Gated
alone, such a folder said PASS (`gate RUN/ops --allow rounding`, exit 0) for a run whose own
verdict it is not. Only os and paths: the gate asks it before reading anything."""
from __future__ import annotations

import os
import re

from tpdiag.records.paths import AUTO_DIR, CONFIRM_DIR, MANIFEST, SECOND_PASS_DIRS, VARIANTS_DIR, WORLD

# the deepest a pass lies under its run: auto/round<i>/region/ops
_DEPTH = 4
_WHAT = {CONFIRM_DIR: "confirmation rerun", AUTO_DIR: "fix chain round", VARIANTS_DIR: "matrix variant"}


def _segment(parts: list[str]) -> tuple[int, str] | None:
    """How many leading parts name one pass of a run, and what it is; None: none does."""
    if len(parts) >= 2 and "/".join(parts[:2]) in SECOND_PASS_DIRS:
        return 2, "second pass"
    if parts[0] in SECOND_PASS_DIRS:
        return 1, "second pass"
    if len(parts) >= 2 and parts[0] in _WHAT and parts[1] not in ("", ".", ".."):
        if parts[0] == AUTO_DIR and not re.fullmatch(r"round[0-9]+", parts[1]):
            return None
        return 2, _WHAT[parts[0]]
    return None


def _passes(parts: list[str]) -> str | None:
    """What the path below a run names where every part of it is one of a run's passes, else None."""
    what = None
    while parts:
        seg = _segment(parts)
        if seg is None:
            return None
        what = what or seg[1]
        parts = parts[seg[0]:]
    return what


def _owner(path: str) -> tuple[str, str, str] | None:
    parts = path.rstrip(os.sep).split(os.sep)
    for up in range(_DEPTH, 0, -1):  # the outermost run first: the one to gate
        if len(parts) <= up + 1:
            continue
        top, below = os.sep.join(parts[:-up]) or os.sep, parts[-up:]
        what = _passes(below)
        if what and os.path.isfile(os.path.join(top, MANIFEST)):
            return top, "/".join(below), what
    return None


def part_of_run(run_dir: str) -> str | None:
    """One line where run_dir (as given, or where its symlinks lead) is a pass inside another run
    directory, else None."""
    for path in dict.fromkeys([os.path.abspath(run_dir), os.path.realpath(run_dir)]):
        got = _owner(path)
        if got:
            top, below, what = got
            return (f"{run_dir}: the {what} {below}/ of the run {top}, not a run of its own (its verdict is "
                    f"part of that run's); gate the run: tpdiag gate {top}")
    return None


def _marked(cfg: dict) -> tuple[str, str, str | None] | None:
    """(what, its folder, its run) where a config (manifest.json's, a world.json's) carries
    config.RerunSpec.pass_of: the run is its `out` less that folder, as the run wrote it (None: not
    there); None where it carries none."""
    below = cfg.get("pass_of")
    if below in (None, ""):
        return None
    what = _WHAT.get(os.path.normpath(str(below)).split(os.sep)[0], "pass")
    out = str(cfg.get("out") or os.path.dirname(str(cfg.get("out_dir") or ""))).rstrip("/")
    cut = out.rfind("/" + str(below))
    return what, str(below), out[:cut] if cut > 0 else None


def _matrix_top(manifest, run_dir: str | None) -> bool:
    """A matrix run's top directory: its manifest is its primary variant's (runner/matrix.py), marked as
    that variant, whose folder lies inside it and whose worlds ARE the top's (tp{label} linked to them,
    or manifest.json's `runs` naming them) - the run the user asked for. Without the worlds' tie two keys
    added to a copied-out variant's manifest.json, and a file at variants/<slug>/, made it a top."""
    if run_dir is None or not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        return False
    variants, top = manifest.get("variants"), manifest.get("matrix_of")
    entry = variants.get(top) if isinstance(variants, dict) and isinstance(top, str) else None
    slug = entry.get("slug") if isinstance(entry, dict) else None
    if not (isinstance(slug, str) and manifest["config"].get("pass_of") == f"{VARIANTS_DIR}/{slug}"
            and os.path.isfile(os.path.join(run_dir, VARIANTS_DIR, slug, MANIFEST))):
        return False
    sub = os.path.join(run_dir, VARIANTS_DIR, slug)
    runs = manifest.get("runs") if isinstance(manifest.get("runs"), dict) else {}
    named = {os.path.realpath(os.path.join(run_dir, v)) for v in runs.values() if isinstance(v, str)}
    worlds = [n for n in sorted(os.listdir(sub)) if os.path.isfile(os.path.join(sub, n, WORLD))]
    return bool(worlds) and all(os.path.realpath(os.path.join(sub, n)) in
                                named | {os.path.realpath(os.path.join(run_dir, n))} for n in worlds)


def world_pass(path: str, world, manifest, run_dir: str) -> str | None:
    """One line where a world's world.json says it ran in a rerun inside a run (config.RerunSpec.pass_of):
    a confirmation's, a fix chain round's or a matrix variant's world, not one of the user's run (the
    primary variant's worlds of a matrix run's top are: manifest and run_dir, the top's)."""
    cfg = world.get("config") if isinstance(world, dict) else None
    if not isinstance(cfg, dict) or (_matrix_top(manifest, run_dir)
                                     and cfg.get("pass_of") == manifest["config"].get("pass_of")):
        return None
    got = _marked(cfg)
    if got is None:
        return None
    what, below, top = got
    return (f"{path}: a world of the {what} {below}/ of {f'the run {top}' if top else 'a run'} (its world.json "
            f"says so), not of the user's run; diff that run's own worlds instead ({top or 'RUN_DIR'}/tpN)")


def rerun_pass(manifest, run_dir: str | None = None) -> str | None:
    """One line where manifest.json's config carries what only tpdiag's own passes set
    (config.RerunSpec: a float64 oracle, modules or ops probed alone, no self-check, some
    configurations only, the folder of a rerun inside its run): a second pass or a rerun moved or
    copied out of its run, never a user's compare. Its records cover a few modules, or it ran fixes the
    user did not choose; gated alone it read as the user's run. run_dir: where it is read (a matrix
    run's top holds its primary variant's manifest, marked as that variant)."""
    from dataclasses import fields

    from tpdiag.config import RerunSpec

    cfg = manifest.get("config") if isinstance(manifest, dict) else None
    if not isinstance(cfg, dict):
        return None
    if isinstance(cfg.get("pass_of"), str) and not _matrix_top(manifest, run_dir):
        got = _marked(cfg)
        if got:
            what, below, top = got
            return (f"{run_dir or 'this run directory'}: the {what} {below}/ of "
                    f"{f'the run {top}' if top else 'a run'}, moved or copied out of it (its manifest.json says so), "
                    f"not a run of its own (its verdict is part of that run's); gate the run: tpdiag gate {top or 'RUN_DIR'}")
    for f in fields(RerunSpec):
        if f.name not in cfg or f.name == "pass_of" and isinstance(cfg[f.name], str):
            continue
        have, want = cfg[f.name], f.default
        if isinstance(have, list):
            have = tuple(tuple(x) if isinstance(x, list) else x for x in have)
        if have != want:
            val = repr(cfg[f.name])
            return (f"manifest.json's config has {f.name} {val if len(val) <= 60 else val[:57] + '...'}, which only a pass tpdiag runs inside a "
                    "run sets (a second pass or rerun, moved or copied out of its run directory): not a run of "
                    "its own; gate the run it belongs to")
    return None
