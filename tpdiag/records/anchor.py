"""world.json `anchor` (runner/anchor.py): the later steps a world started from the reference's state."""
from __future__ import annotations


def anchored_steps(world: dict | None) -> set[int]:
    """The steps whose forward read the reference's parameters, moments and buffers (loaded before the
    step), not this world's own last update: {} where the world was not anchored or refused it."""
    got = (world or {}).get("anchor") if isinstance(world, dict) else None
    steps = got.get("steps") if isinstance(got, dict) else None
    return {int(s) for s in steps if isinstance(s, int) and s > 0} if isinstance(steps, list) else set()


def not_anchored(world: dict | None) -> dict | None:
    """{step, why} where this world's config asked for the anchor over later training steps but its
    later steps ran from its own state: it refused (world.json `anchor.refused`), or it never loads (a
    configuration of the reference's degree - a micro-batch or attention axis at TP=1 - keeps its own,
    runner/anchor.loads); None where it was anchored or nothing was asked."""
    if not isinstance(world, dict):
        return None
    got = world.get("anchor")
    if isinstance(got, dict):
        return {"step": got.get("refused_at"), "why": str(got["refused"])} if got.get("refused") else None
    cfg = world.get("config") if isinstance(world.get("config"), dict) else {}
    later = cfg.get("anchor") is True and cfg.get("backward", True) and int(cfg.get("steps", 1) or 1) > 1
    if later and cfg.get("mode", "prefill") != "decode":
        deg = cfg.get("degree")
        why = (f"a TP={deg} world keeps its own state: only a TP > 1 world loads the reference's"
               if isinstance(deg, int) and deg <= 1 else "it loaded no state (world.json names no anchored step)")
        return {"step": 1, "why": why}
    return None
