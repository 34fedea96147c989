"""Rows of a step re-anchored at the reference's state (runner/anchor.py, world.json `anchor`): the
weights that step's forward read are the reference's at both sides - not the last update's records,
which are this side's own update from the state before."""
from __future__ import annotations


def steps(rows: list) -> set[int]:
    """The anchored steps among the rows (engine.diff_degree marks each of their rows)."""
    return {int(r["step"]) for r in rows if r.get("anchored")}


def read_pair(dd, key: str, step: int):
    """(reference, this side) of a parameter record as step `step`'s forward read it (`key`: the
    record it was read from - the init, or the step before's update): at an anchored step the
    reference's at both sides; else dd.tensors' pair (None where not held). dd.anchored: the steps
    engine.diff_degree marked."""
    pair = dd.tensors.get(key)
    if pair is None or not step or int(step) not in dd.anchored:
        return pair
    return pair[0], pair[0]
