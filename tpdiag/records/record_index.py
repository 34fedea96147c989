"""A degree's record index - world.json's record format and events.jsonl, every line checked - read
without opening its tensors (records/store.py's RecordSet reads the same index, then the tensors)."""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records.base_world import base_dir, base_drop, base_problem
from tpdiag.records.paths import EVENTS, WORLD, world_file

# The layout of a record set (events.jsonl's fields, how tensors are stored and keyed): bump it with any
# change a reader of the previous layout would misread. A world.json written before the field existed
# (no "record_format") is the first layout. A set of another format is refused in one line, never read
# as this one (the lane mix has its own version: records/hashing.py).
# 2: a module's op records keyed by the module's call (`op#C`) and counted within that call - format 1
# counted them across a module's calls, so a module called twice paired one call's op with another
# call's (loop_stage.py's false BUG); a capture of each format diffed together would pair them so.
# 3: the root's module records under ROOT_NAMESAKE "(root)" where a top-level child is named "model"
# (records/keys.py) - format 2 recorded both as "model", the root's call 0 and the child's call 1, so
# a format-2 run diffed with a format-3 one would pair the root's call with its child's.
# 4: the root's own parameters and written buffers record under that name too (its float64 backward
# judges their grads) - format 3 recorded them under "model": a format-3 run diffed with this one would
# leave them unpaired, so its grads would go unjudged rather than refused.
RECORD_FORMAT = 4


def check_format(world: dict, path: str) -> None:
    """Refuse a record set written in another layout than this tpdiag reads (Inconclusive, one line)."""
    v = world.get("record_format", 1)
    if is_int(v) and v == RECORD_FORMAT:
        return
    from tpdiag import __version__

    by = world.get("tpdiag")
    who = f"tpdiag {by}" if isinstance(by, str) else "another tpdiag"
    raise Inconclusive(f"{path}: record format {v!r} (written by {who}); this tpdiag ({__version__}) reads "
                       f"format {RECORD_FORMAT}: read it with the tpdiag that wrote it, or run it again with this one")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The fields every reader relies on (tpdiag/probes/recorder.py writes them, gather adds
# stored/world): checked once here so an edited events.jsonl is Inconclusive, not a KeyError
# or a wrong comparison somewhere downstream.
_STR_FIELDS = ("key", "phase", "module", "kind", "name", "dtype")
_OPT_STR_FIELDS = ("placement", "style", "cls")


def check_event(m, line: int, path: str) -> None:
    def bad(what: str):
        raise Inconclusive(f"{path}: line {line}: {what} (edited or not a tpdiag record index)")

    if not isinstance(m, dict):
        bad(f"a {type(m).__name__}, expected a JSON object")
    for k in ("idx", "step", "call"):
        if not is_int(m.get(k)) or m[k] < 0:
            bad(f"{k} {m.get(k)!r} is not an integer >= 0")
    for k in _STR_FIELDS:
        if not isinstance(m.get(k), str):
            bad(f"{k} {m.get(k)!r} is not a string")
    for k in _OPT_STR_FIELDS:
        if m.get(k) is not None and not isinstance(m[k], str):
            bad(f"{k} {m[k]!r} is not a string")
    shape = m.get("local_shape")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        bad(f"local_shape {shape!r} is not a list of sizes")
    if "world" in m and (not is_int(m["world"]) or m["world"] < 1):
        bad(f"world {m['world']!r} is not an integer >= 1")
    if m.get("stored", "single") not in ("single", "stacked", "hash"):
        bad(f"stored {m.get('stored')!r} is not 'single', 'stacked' or 'hash'")
    if m.get("stored") == "hash":
        h = m.get("full_hash")
        if h is not None and not (isinstance(h, str) and len(h) == 16
                                  and all(c in "0123456789abcdef" for c in h)):
            bad(f"full_hash {h!r} is not 16 hex digits")
        full = m.get("full_shape")
        if not isinstance(full, list) or not all(is_int(n) and n >= 0 for n in full):
            bad(f"full_shape {full!r} is not a list of sizes")
        stats = m.get("stats")
        if h is not None and (not isinstance(stats, dict) or not all(
                isinstance(stats.get(k), (int, float)) and not isinstance(stats.get(k), bool)
                for k in ("nonfinite", "sum", "sumsq", "absmax"))):
            bad(f"stats {stats!r} are not the four numbers nonfinite/sum/sumsq/absmax")
    if m.get("stored") == "stacked" and m.get("world", 1) < 2:
        bad("a stacked record of a world of one rank")


def read_index(out_dir: str) -> tuple[dict, list[dict]]:
    """world.json and the checked events.jsonl of a degree, without opening its tensors (a world
    with a records_base: its base's events less base_drop's kinds, then its own)."""
    epath = os.path.join(out_dir, EVENTS)
    world = io.read_json(world_file(out_dir, WORLD))
    if not isinstance(world, dict):
        raise Inconclusive(f"{world_file(out_dir, WORLD)}: not a JSON object")
    check_format(world, world_file(out_dir, WORLD))
    events = io.read_jsonl(epath)
    for i, m in enumerate(events):
        check_event(m, i + 1, epath)
    base = base_dir(out_dir, world)
    if base is not None:
        below, under = read_index(base)
        why = base_problem(world, below, base)
        if why:
            raise Inconclusive(f"{world_file(out_dir, WORLD)}: {why}")
        drop = base_drop(world["config"], below["config"])
        events = [m for m in under if m["kind"] not in drop] + events
    return world, events


def check_steps(world: dict, events: list[dict], epath: str) -> None:
    """A compare world (world.json's config names its model) records every step it ran: a step's records
    cut from both sides alike (and n_records edited to match) re-diff clean, so a bug only a later step
    shows passed the gate (red team, round 5). A capture's steps are the user's loop's: not checked."""
    cfg = world.get("config")
    steps = cfg.get("steps") if isinstance(cfg, dict) and "model" in cfg else None
    if not is_int(steps) or steps < 1 or not events:
        return
    seen = {m["step"] for m in events}
    gone = sorted(set(range(steps)) - seen)
    extra = sorted(seen - set(range(steps)))
    if gone or extra:
        what = (f"no record of step {gone[0]}" if gone else f"records of step {extra[0]}")
        raise Inconclusive(f"{epath}: {what}, but world.json says the world ran {steps} step(s) (records removed, "
                           "or edited after the run)")
