"""A `tpdiag diff` directory's two sides must be two runs (red team, round 5: `tpdiag diff RUN/tp2
RUN/tp2`, a capture against itself, passed the default gate as "bitwise"). Only file reads
(records/ is the contract layer); records/sides.py checks a compare's own worlds and passes.
"""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import MANIFEST, WORLD, world_file


def _side_file(path: str) -> str | None:
    """The file that says which run a diff side is: a compare world's world.json, a capture's manifest."""
    for name in (WORLD, MANIFEST):
        p = world_file(path, name) if name == WORLD else os.path.join(path, name)
        if os.path.isfile(p):
            return p
    return None


def diff_side_problems(run_dir: str, manifest: dict) -> list[str]:
    """A `tpdiag diff` directory's two sides must be two runs: not one directory named twice (a capture
    diffed against itself is bitwise whatever it holds), not a byte-for-byte copy of one (a rerun writes
    its own times and timings), and each of the degree the manifest says it is."""
    runs = manifest.get("runs")
    labels = manifest.get("labels")
    degrees = manifest.get("degrees")
    if not isinstance(runs, dict) or not isinstance(labels, list) or len(labels) != 2:
        return ["manifest.json of a tpdiag diff names no two runs (edited, or not what tpdiag diff writes)"]
    paths = [runs.get(str(lab)) for lab in labels]
    if not all(isinstance(p, str) and p for p in paths):
        return [f"manifest.json of a tpdiag diff names no run for {', '.join(map(str, labels))} (edited)"]
    paths = [p if os.path.isabs(p) else os.path.join(run_dir, p) for p in paths]
    if os.path.realpath(paths[0]) == os.path.realpath(paths[1]):
        return [f"both sides of this tpdiag diff are {os.path.realpath(paths[0])}: a run diffed against itself "
                "is bitwise whatever it holds; diff two runs"]
    files = [_side_file(p) for p in paths]
    out = []
    if all(files):
        try:
            with io.open_regular(files[0], encoding=None) as a, io.open_regular(files[1], encoding=None) as b:
                if a.read() == b.read():
                    out.append(f"the two sides of this tpdiag diff ({paths[0]}, {paths[1]}) are copies of one run "
                               f"(their {os.path.basename(files[0])} are byte for byte the same); diff two runs")
        except (OSError, Inconclusive):
            pass  # unreadable: the re-diff of the records says so
    if isinstance(degrees, list) and len(degrees) == 2:
        for p, want in zip(paths, degrees):
            why = _capture_problem(p, want)
            if why:
                out.append(why)
        for p, f, want in zip(paths, files, degrees):
            if f is None or os.path.basename(f) != WORLD:
                continue
            try:
                w = io.read_json(f)
            except Inconclusive as e:
                out.append(str(e).splitlines()[0])
                continue
            have = w.get("degree") if isinstance(w, dict) else None
            if type(have) is not int or have != want:
                out.append(f"{f} is a world of degree {have!r} but this tpdiag diff's manifest.json says {want!r} "
                           "(another run's records, or edited)")
    return out


def _capture_problem(path: str, want) -> str | None:
    """A side with a manifest.json is a capture (a compare world has none): `tpdiag diff` read it only
    where that manifest said the capture is complete (diff/runs.read_capture), so the gate asks it
    again. Edited afterwards - complete false (a capture its job never finished writing), another
    degree than its world.json's - the diff passed the gate as it stood (red team hred22)."""

    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        # a compare world (RUN_DIR/tpN) has none: its world.json carries the compare's config
        try:
            w = io.read_json(world_file(path, WORLD))
        except Inconclusive:
            return None  # the re-diff of the records says what is missing
        cfg = w.get("config") if isinstance(w, dict) else None
        if isinstance(cfg, dict) and "model" in cfg and "label" in w:
            return None
        return (f"{path}: a capture without manifest.json (its job writes it last: cut short, or the file "
                "removed), but this tpdiag diff read it as a complete capture")
    try:
        m = io.read_json(mpath)
    except Inconclusive as e:
        return str(e).splitlines()[0]
    if not isinstance(m, dict) or m.get("tool") != "tpdiag.capture" or m.get("complete") is not True:
        tool, done = (m.get("tool"), m.get("complete")) if isinstance(m, dict) else (None, None)
        return (f"{mpath}: not a complete tpdiag.capture manifest (tool {tool!r}, complete {done!r}), but this "
                "tpdiag diff read it as one (the capture was cut short, or its manifest edited)")
    have = m.get("degree")
    if type(have) is not int or have != want:
        return (f"{mpath} is a capture of degree {have!r} but this tpdiag diff's manifest.json says {want!r} "
                "(another capture, or edited)")
    return None
