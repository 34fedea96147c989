"""The own-input reference's base world: a world whose config names a `records_base` (WorldConfig)
records only its own float64 re-execution and reads the rest of its set from the region reference
beside it - which folder that is, what it reads from there, and why a folder is not that world."""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive
from tpdiag.records.paths import WORLD, world_file

# A world whose config names a `records_base` (WorldConfig: the own-input pass's reference) records
# only OWN_KINDS; the rest of its set is its base's records less those kinds - and less its ops where
# the base recorded ops and this world records none (base_drop)
OWN_KINDS = ("oracle",)
# where a world with a base may differ from the base's world (world.json's config): its folders and
# what only its float64 re-execution is (the records of these kinds are its own)
_BASE_MAY_DIFFER = ("out_dir", "ref_dir", "records_base", "oracle", "oracle_ops", "oracle_own", "granularity",
                    "op_include")


def base_dir(out_dir: str, world: dict) -> str | None:
    """The folder a world's `records_base` names, found from this world's own folder (both paths as
    the compare wrote them, so a run directory moved whole still agrees): a world folder beside
    this pass's run directory (region/ops/tp1 -> region/tp1), nothing else; None without one."""
    cfg = world.get("config")
    base = cfg.get("records_base") if isinstance(cfg, dict) else None
    if not base:
        return None
    od = cfg.get("out_dir")
    where = world_file(out_dir, WORLD)
    if not isinstance(base, str) or not isinstance(od, str) or not od or os.path.isabs(base) != os.path.isabs(od):
        raise Inconclusive(f"{where}: records_base {base!r} is not a folder of this run (edited after the run)")
    from tpdiag.records.paths import is_world_folder

    parts = os.path.relpath(os.path.normpath(base), os.path.normpath(od)).split(os.sep)
    if len(parts) != 3 or parts[:2] != ["..", ".."] or not is_world_folder(parts[2]):
        raise Inconclusive(f"{where}: records_base {base!r} is not a world folder beside this pass's run directory "
                           "(edited after the run)")
    return os.path.normpath(os.path.join(out_dir, *parts))


def base_drop(cfg: dict, bcfg: dict) -> tuple | None:
    """The kinds a world with a base (config cfg) reads none of from its base (config bcfg): its own
    kinds, and the base's ops where it records none; None where it records other ops than the base."""
    ops = ("granularity", "op_include")
    if [cfg.get(k) for k in ops] == [bcfg.get(k) for k in ops]:
        return OWN_KINDS
    if [cfg.get(k) for k in ops] == ["module", []]:
        return ("op",) + OWN_KINDS
    return None


def base_problem(world: dict, below: dict, base: str) -> str | None:
    """Why `below` (the base's world.json) is not the world whose other records this world stands on:
    another configuration or settings, another step (their fingerprints: the step's logits, loss and
    every updated parameter, per rank), or a base of its own."""
    cfg, bcfg = world.get("config"), below.get("config")
    if not isinstance(bcfg, dict) or not isinstance(cfg, dict):
        return f"its base {base} has no config (not what tpdiag compare writes)"
    if bcfg.get("records_base"):
        return f"its base {base} reads its records from another base (not what tpdiag compare writes)"
    if base_drop(cfg, bcfg) is None:
        return f"its base {base} recorded other ops than this world (not what tpdiag compare writes)"
    for k in ("label", "degree"):
        if below.get(k) != world.get(k):
            return f"its base {base} is the world of {k} {below.get(k)!r}, not {world.get(k)!r} (mismatched files)"
    mine, theirs = ({k: v for k, v in c.items() if k not in _BASE_MAY_DIFFER} for c in (cfg, bcfg))
    if mine != theirs:
        k = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        return f"its base {base} ran {k} {theirs.get(k)!r}, this world {mine.get(k)!r} (another world's records)"
    fp = world.get("fingerprint")
    if not isinstance(fp, list) or not fp or not all(fp) or below.get("fingerprint") != fp:
        return (f"its base {base} computed another step (their step fingerprints differ): its records are not "
                "this world's")
    return None
