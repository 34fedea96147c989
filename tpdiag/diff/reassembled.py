"""A collective only this degree runs, whose result is put back together into a value the reference
computed bit for bit: context parallelism's keys and values all-gathered over the positions and
concatenated - the `cat` after the all-gather holds exactly the reference's `wk` output. No
difference entered there, so the op pass must not name it as where one did (first_op._first_op took
the first TP-only collective before the first differing shared op: the v all-gather, not the
attention after it whose top-left causal mask was the mistake - tests/models/planted/
context_parallel.py:cp_is_causal). Known from the records' hashes alone (the same lane mix at both
sides), for a value every rank holds alike."""
from __future__ import annotations

_COLLECTIVE = ("c10d::", "_c10d_functional::")


def index(ref) -> dict:
    """(hash, dtype, shape) -> the first reference record with that value."""
    ix: dict = {}
    for m in ref.events:
        h = m.get("hash")
        if h:
            ix.setdefault((h, m.get("dtype"), tuple(m.get("local_shape") or ())), m["key"])
    return ix


def same_as(om: dict, ix: dict) -> str | None:
    """The reference record whose value this degree's op output is, bit for bit (every rank alike)."""
    if om.get("ranks_equal") is not True or not om.get("hash"):
        return None
    return ix.get((om["hash"], om.get("dtype"), tuple(om.get("local_shape") or ())))


def exact(collective: dict, uncompared: list, hi: float) -> bool:
    """The collective's result, as the first non-collective op only this degree runs after it (before
    hi) assembles it, is a value the reference computed."""
    after = sorted((m for m in uncompared if m.get("kind") == "op" and collective["idx"] < m["idx"] < hi
                    and m.get("why") == "only at this degree"), key=lambda m: m["idx"])
    nxt = next((m for m in after if not str(m.get("name", "")).startswith(_COLLECTIVE)), None)
    return bool(nxt and nxt.get("same_as"))
