"""A world's rank markers (tpN/rankR.done) as its readers check them: each rank's own, read whole.

Why read them: a marker is the rank's word that it finished, written after its records and world.json
(runner/worker.py). A marker whose bytes were cut (a job killed while the disk wrote it, a copy that
stopped part way) or that names another rank (rank1.done copied over rank0.done) is no such word;
only a regular file that parses as this rank's marker counts.
"""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records.paths import rank_marker, world_file


def undone(d: str, degree: int) -> tuple[int, str] | None:
    """(rank, why) of the first rank of world folder `d` without a finished marker, or None."""
    for r in range(degree):
        m = world_file(d, rank_marker(r, "done"))
        if not os.path.isfile(m) or os.path.islink(m):
            return r, "is missing (the rank never finished its work)"
        try:
            got = io.read_json(m)
        except Inconclusive as e:
            what = str(e).splitlines()[0].split(": ", 1)[-1]  # the path is said by the caller
            return r, f"is unreadable ({what}): cut short, so not the rank's word that it finished"
        if not isinstance(got, dict) or got.get("rank") != r:
            who = got.get("rank") if isinstance(got, dict) else got
            return r, f"is not rank {r}'s marker (it says rank {who!r})"
    return None
