"""Whose records are these? A world's files must be the world the manifest says ran, and the two sides of
a `tpdiag diff` two different runs. Found by a red-team review (round 5): a divergent TP=1,2 run whose tp2/
was overwritten by tp1/'s world.json, events.jsonl and records.safetensors - diff.csv and summary.json
re-derived from the files with tpdiag's own code, the second pass removed - passed the default gate as
"bitwise" (exit 0); so did `tpdiag diff RUN/tp2 RUN/tp2` (a capture against itself).

Only file reads (records/ is the contract layer). What no reader can tell without a key: a forger who
edits every JSON field of a copied world consistently (degree, label, each record's `world`, the
fingerprints) - docs/ci.md says so. These checks make the cheap forgeries - files copied, not rewritten -
fail closed.
"""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.base.configs import folder
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import EVENTS, MANIFEST, RESULT, TENSORS, WORLD, rank_marker, world_file


def world_identity_problem(world: dict, label: str, degree, where: str, run_out=None, linked=None) -> str | None:
    """Where world.json describes another world than the manifest's TP=label at `degree`: another
    degree's records copied in (its events name their world size too, so a copied set stays
    self-consistent - only world.json's own degree and label, and its one fingerprint per rank, tell),
    or a world another compare wrote (run_out: manifest.json's config `out`, where this compare wrote its
    worlds; both paths are as the run wrote them, so a run directory moved or copied whole still agrees).
    linked: the manifest's `records_from` - a world an earlier pass of this compare ran, linked in
    (runner/compare._linked): its world.json names that folder."""
    cfg = world.get("config") if isinstance(world.get("config"), dict) else {}
    od = cfg.get("out_dir")
    if isinstance(linked, str) and linked and isinstance(od, str) and od:
        if not _same_path(od, linked):
            return (f"{where} was written into {od}, but manifest.json says this world's records are those of "
                    f"{linked}: a world of another run copied in")
    elif isinstance(run_out, str) and run_out and isinstance(od, str) and od and \
            not _same_path(os.path.dirname(od), run_out):
        return (f"{where} was written into {od}, by another compare than this run's (which wrote into {run_out}): "
                "a world of another run copied in")
    for name, have in (("degree", world.get("degree")), ("label", world.get("label")),
                       ("config degree", cfg.get("degree", degree)), ("config label", cfg.get("label", label))):
        want = degree if "degree" in name else label
        same = (type(have) is int and have == want) if "degree" in name else str(have) == str(want)
        if not same:
            return (f"{where} is the world of {name} {have!r} but manifest.json ran TP={label} (degree {degree!r}) "
                    "here: another world's records copied in, or edited after the run")
    fp = world.get("fingerprint")
    if isinstance(fp, list) and type(degree) is int and len(fp) != degree:
        return (f"{where} holds {len(fp)} rank fingerprint(s) for a world of {degree} ranks: another world's "
                "records copied in, or edited after the run")
    return None


# What every world of one compare ran with (CompareConfig.world copies them from the compare's own
# settings; the axes - degree, micro-batch, mode, fix - are what differ between worlds): a world.json
# that disagrees with manifest.json is another run's records, or the manifest was edited to describe
# a run that never happened (another model, dtype or seed would pass as this one).
# The fixes, plan variant and numerics flags too: a --fix all run (bitwise) whose manifest.json was edited
# to say no fix ran passed the default gate as the stock model's TP=1,2 being bitwise (red team, round 5).
_SAME_SETTINGS = ("model", "dtype", "seed", "batch_size", "seq_len", "steps", "layers", "fixes", "variant", "flags",
                  "tree_groups", "group_gemm")
# manifest.json's own copies of settings its config holds
_TOP_SETTINGS = ("model", "dtype", "seed", "fixes", "flags", "tree_groups", "group_gemm")


def settings_problem(manifest: dict, d: str, label: str, who: str, degree=None) -> str | None:
    """Where world.json's settings (and record hash version) are not manifest.json's."""
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    for k in _TOP_SETTINGS:
        if k in manifest and k in cfg and manifest[k] != cfg[k]:
            return f"manifest.json says {k} {manifest[k]!r} but its own config says {cfg[k]!r} (edited after the run)"
    # the top-level copies stand in for a config removed from the manifest
    cfg = {**{k: manifest[k] for k in _TOP_SETTINGS if k in manifest}, **cfg}
    try:
        world = io.read_json(world_file(d, WORLD))
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    wcfg = world.get("config") if isinstance(world, dict) else None
    if not isinstance(wcfg, dict):
        return f"{who}: {folder(label)}/{WORLD} has no config (not what tpdiag compare writes)"
    entry = (manifest.get("worlds") or {}).get(label) if isinstance(manifest.get("worlds"), dict) else None
    linked = entry.get("records_from") if isinstance(entry, dict) else None
    why = world_identity_problem(world, label, degree, f"{folder(label)}/{WORLD}", cfg.get("out"), linked)
    if why:
        return f"{who}: {why}"
    # A world that wrote only its float64 records reads the rest from its base (records/store.py): the
    # compare that ran it says which (manifest.json's worlds[label].records_base). world.json's base
    # dropped, the world read as a set of its own - its float64 records alone (red team hred10).
    mine = entry.get("records_base") if isinstance(entry, dict) else None
    theirs = wcfg.get("records_base") or None
    if (mine or theirs) and not (isinstance(mine, str) and isinstance(theirs, str) and _same_path(mine, theirs)):
        return (f"{who}: {folder(label)}/{WORLD}'s records_base {theirs!r} is not the base manifest.json ran it on "
                f"({mine!r}): edited after the run")
    for k in _SAME_SETTINGS:
        if k in cfg and wcfg.get(k) != cfg[k]:
            return (f"{who}: {folder(label)}/{WORLD} ran {k} {wcfg.get(k)!r} but manifest.json says {cfg[k]!r} "
                    "(another run's records, or manifest.json edited)")
    hv = manifest.get("hash_version")
    if "hash_version" in world and hv != world["hash_version"]:
        return (f"{who}: {folder(label)}/{WORLD} hashed its records with version {world['hash_version']!r} but "
                f"manifest.json says {hv!r} (edited after the run)")
    # A world.json without the version is an older tpdiag's run (read as record format 1, re-checked
    # like any run); one naming another version than the manifest's is a world another tpdiag wrote, in
    # a reused directory or copied in, read beside this run's as if one tool had made both.
    from tpdiag.records.store import check_format

    try:
        check_format(world, f"{folder(label)}/{WORLD}")  # another layout: say that, not the version
    except Inconclusive as e:
        return f"{who}: {e}"
    mv = (manifest.get("versions") or {}).get("tpdiag") if isinstance(manifest.get("versions"), dict) else None
    wv = world.get("tpdiag")
    if "record_format" in world and wv is None:
        return f"{who}: {folder(label)}/{WORLD} names a record format but no tpdiag version (edited after the run)"
    if wv is not None and wv != mv:
        return (f"{who}: {folder(label)}/{WORLD} was written by tpdiag {wv!r} but manifest.json by tpdiag {mv!r} "
                "(another tpdiag's records in this run directory, or edited)")
    return None


def pass_identity_problem(manifest: dict, sub, name: str, added_fixes: tuple = (), here: str | None = None) -> str | None:
    """A later pass's folder of this run (the second pass: ops/, region/...) must be this run's: written
    where this compare wrote it (its config `out` this run's own joined with the folder's name, both as
    the run wrote them, so a run directory moved whole still agrees), with this run's settings, started
    after it. Another run's ops/ copied in (another step count, a decode configuration's) passed
    `gate --allow rounding` with that run's float64 verdicts read as this run's (red team, hred9).
    added_fixes: the fixes this pass ran on top of the run's (a confirmation's, confirm/<fix>/). here: the
    folder's path as read now - `tpdiag confirm` on a run directory moved since writes into it there."""
    cfg = manifest.get("config") if isinstance(manifest, dict) else None
    scfg = sub.get("config") if isinstance(sub, dict) else None
    if not isinstance(cfg, dict):
        return None  # integrity.problems says what is wrong with the run's own manifest
    if not isinstance(scfg, dict):
        return f"{name}/manifest.json has no config (not what tpdiag compare writes)"
    out, sout = cfg.get("out"), scfg.get("out")
    moved_here = isinstance(sout, str) and sout and here is not None and _same_path(sout, os.path.abspath(here))
    if isinstance(out, str) and out and not moved_here and not (
            isinstance(sout, str) and sout and _same_path(sout, os.path.join(out, name))):
        return (f"{name}/manifest.json was written into {sout!r}, not this run's {os.path.join(out, name)!r}: "
                "another run's pass copied in, or edited after the run")
    for k in _SAME_SETTINGS:
        want = cfg.get(k)
        if k == "fixes" and added_fixes and isinstance(want, list):
            want = [*want, *added_fixes]
        if k in cfg and scfg.get(k) != want:
            return (f"{name}/manifest.json ran {k} {scfg.get(k)!r} but manifest.json says {want!r} (another run's "
                    "pass copied in, or edited after the run)")
    mine, theirs = started(manifest), started(sub)
    if mine is not None and theirs is not None and theirs < mine:
        return (f"{name}/ started at {sub.get('started')}, before this run did ({manifest.get('started')}): an "
                "earlier run's pass, not this run's")
    return None


def _same_path(a: str, b: str) -> bool:
    """Two paths one compare wrote, either absolute or relative to where it ran."""
    a, b = os.path.normpath(a), os.path.normpath(b)
    if a == b:
        return True
    if os.path.isabs(a) == os.path.isabs(b):
        return False
    rel, full = (a, b) if not os.path.isabs(a) else (b, a)
    return full.endswith(os.sep + rel)


def fix_chain_problems(run_dir: str, manifest: dict, summary: dict) -> list[str]:
    """`--fix auto`: every round the compare ran is gated (gate/verdict._judge_chain), so none may be
    missing from summary.json's fix_chain - a later round that finds a bug a reordering hid is the user's
    model's bug too, and a chain cut before it (or removed) passed `--allow rounding` on round 0 alone.
    manifest.json says how many rounds ran (`fix_chain_rounds`, written with its final status); a round's
    folder auto/roundN/ this run wrote must be in the chain too."""
    chain = summary.get("fix_chain")
    n = manifest.get("fix_chain_rounds")
    if chain is not None and (not isinstance(chain, list) or not all(isinstance(r, dict) for r in chain)):
        return []  # gate/verdict._judge_chain says so
    rounds = [r.get("round") for r in chain or ()]
    if rounds != list(range(len(rounds))):
        return [f"summary.json's fix_chain has the rounds {rounds!r}, not 0..{len(rounds) - 1} (edited after the run)"]
    if n is not None and (type(n) is not int or n != len(rounds)):
        return [f"manifest.json says the fix chain ran {n!r} rounds but summary.json's fix_chain lists {len(rounds)} "
                "(rounds removed, or edited after the run)"]
    why = _rounds_identity_problem(run_dir, manifest, chain or [])
    if why:
        return [why]
    mine = started(manifest)
    try:
        folders = os.listdir(os.path.join(run_dir, "auto"))
    except OSError:
        folders = []
    for name in sorted(folders):
        i = name[5:]
        sub = os.path.join(run_dir, "auto", name)
        if not (name.startswith("round") and i.isdigit() and int(i) >= max(len(rounds), 1)
                and os.path.isfile(os.path.join(sub, MANIFEST))):
            continue
        try:
            theirs = started(io.read_json(os.path.join(sub, MANIFEST)))
        except Inconclusive:
            theirs = mine  # unreadable: not proven an earlier run's
        if mine is None or theirs is None or theirs >= mine:
            return [f"auto/{name}/ holds a round of this run's fix chain that summary.json's fix_chain does not list "
                    "(rounds removed, or edited after the run)"]
    return []


def _rounds_identity_problem(run_dir: str, manifest: dict, chain: list) -> str | None:
    """Each later round's folder (auto/roundN/) is this run's, as a second pass's is: written into this
    run's auto/roundN/, with its settings and the round's fixes (summary.json's fix_chain: the run's own,
    then those the chain added), started after it. Another run's round copied in (a round that found
    nothing, over one that found a bug) is gated as its own run and passed (red team hred10)."""
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else None
    if cfg is None:
        return None
    own = cfg.get("fixes") if isinstance(cfg.get("fixes"), list) else []
    for rnd in chain:
        i = rnd.get("round")
        if type(i) is not int or i < 1:
            continue
        name = f"auto/round{i}"
        fixes = rnd.get("fixes")
        if not isinstance(fixes, list) or fixes[:len(own)] != own:
            return (f"summary.json's fix_chain round {i} ran the fixes {fixes!r}, not the run's own {own!r} and "
                    "those the chain added (edited after the run)")
        sub = os.path.join(run_dir, name)
        try:
            theirs = io.read_json(os.path.join(sub, MANIFEST))
        except Inconclusive as e:
            # a round the chain lists whose folder or manifest is gone: the gate said so (it evaluates the
            # round), `tpdiag report` wrote the page and exited 0 (red team hred22)
            return f"the fix chain's round {i}: {str(e).splitlines()[0]}"
        why = pass_identity_problem(manifest, theirs, name, tuple(fixes[len(own):]), here=sub)
        if why:
            return f"the fix chain's round {i}: {why}"
    return None


def started(manifest) -> float | None:
    import datetime

    try:
        return datetime.datetime.strptime(manifest["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (TypeError, KeyError, ValueError):
        return None


def base_world_problem(run_dir: str, d: str, who: str, degree) -> str | None:
    """A world that wrote only its float64 records (the own-input pass's reference) reads the rest from
    its base, the region pass's reference (records/store.py): that folder must be a finished world of
    the enclosing run, read from inside it, of this world's configuration and step."""
    from tpdiag.records.base_world import base_dir, base_problem

    try:
        world = io.read_json(world_file(d, WORLD))
        base = base_dir(d, world) if isinstance(world, dict) else None
    except Inconclusive as e:
        return f"{who}: {str(e).splitlines()[0]}"
    if base is None:
        return None
    root = os.path.realpath(os.path.dirname(os.path.normpath(run_dir)))
    if os.path.commonpath([os.path.realpath(base), root]) != root:
        return f"{who}: its base {base} resolves to {os.path.realpath(base)}, outside the run directory; refused"
    for name in (EVENTS, TENSORS, WORLD, RESULT):
        p = os.path.join(base, name)
        if os.path.islink(p) and os.path.commonpath([os.path.realpath(p), root]) != root:
            return f"{who}: its base's {name} is a symlink out of the run directory; refused"
    try:
        res = io.read_json(world_file(base, RESULT))
        below = io.read_json(world_file(base, WORLD))
    except Inconclusive as e:
        return f"{who}: its base: {str(e).splitlines()[0]}"
    if not isinstance(res, dict) or res.get("status") != "ok" or not isinstance(below, dict):
        return f"{who}: its base {base} is not a world that finished ok"
    from tpdiag.records.markers import undone

    gone = undone(base, degree)
    if gone:
        return f"{who}: its base's {rank_marker(gone[0], 'done')} {gone[1]}"
    why = base_problem(world, below, base)
    return f"{who}: {why}" if why else None
