"""world.json `anchor` (runner/anchor.py): the later steps a world started from the reference's state."""
from __future__ import annotations


def anchored_steps(world: dict | None) -> set[int]:
    """The steps whose forward read the reference's parameters, moments and buffers (loaded before the
    step), not this world's own last update: {} where the world was not anchored or refused it."""
    got = (world or {}).get("anchor") if isinstance(world, dict) else None
    steps = got.get("steps") if isinstance(got, dict) else None
    return {int(s) for s in steps if isinstance(s, int) and s > 0} if isinstance(steps, list) else set()
