"""What a compare world's record set must hold beside what its index lists (store.RecordSet reads
these at open): no tensor that no record names, and - where the world ran backward - backward
records at every step. Each is an edit that re-diffs clean otherwise (red team hred14): a tensor
slipped into records.safetensors is never read, so nothing shows it; every backward record cut from
both sides alike (tensors and counts made to agree) leaves the loss and grad checks nothing to
compare, and a loss bug reads rounding."""
from __future__ import annotations

from tpdiag.errors import Inconclusive


def orphan_tensors(keys: set, events: list[dict], path: str, epath: str) -> None:
    """Every tensor in the file is a record's (records/store.write stores exactly the listed ones)."""
    named = {str(m["idx"]) for m in events if m.get("stored") != "hash"}
    extra = sorted(keys - named, key=lambda k: (len(k), k))
    if extra:
        raise Inconclusive(f"{path}: {len(extra)} tensor(s) that no record in {epath} names (first: "
                           f"{extra[0]!r}): added after the run, or another world's file")


def backward_ran(world: dict, events: list[dict], epath: str) -> None:
    """A compare world (world.json's config names its model) whose config says it ran backward holds
    backward records at each step it ran; a capture's phases are the user's loop's, and a pass scoped to
    some modules (module_include) records theirs only: not checked."""
    cfg = world.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg or cfg.get("backward") is not True or not events \
            or cfg.get("module_include"):
        return
    steps = cfg.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return
    with_grads = {m["step"] for m in events if m["phase"] == "backward"}
    gone = [s for s in range(steps) if s not in with_grads]
    if gone:
        raise Inconclusive(f"{epath}: no backward record of step {gone[0]}, but world.json says the world ran "
                           "backward (records removed, or edited after the run)")
