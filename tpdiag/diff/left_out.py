"""What a world compared at a boundary only, from its own records: the blocks whose insides are other
modules per rank (an expert-parallel MoE's experts) or per piece (an MoE's experts across micro-batches
and decode calls), the parameters and op streams it left out there (runner/per_rank.py,
probes/piece_merge.py)."""
from __future__ import annotations

from tpdiag.records.store import RecordSet


def per_rank_blocks(rs: RecordSet) -> dict[str, list[str]]:
    """{block: its per-rank submodules}: the modules this world compared at their boundary only
    (runner/per_rank.py: an expert-parallel MoE's experts are other experts per rank)."""
    return {m["module"]: m["per_rank_inside"] for m in rs.events
            if isinstance(m.get("per_rank_inside"), list)}


def per_piece_blocks(rs: RecordSet) -> dict[str, list[str]]:
    """{block: its submodules left out}: the MoE experts modules whose dispatch this world's pieces
    (micro-batches, decode calls) could not place in the whole call (probes/piece_merge.py), so
    they are compared at their boundary only."""
    return {m["module"]: m["per_piece_inside"] for m in rs.events
            if isinstance(m.get("per_piece_inside"), list)}


def per_rank_params(rs: RecordSet) -> dict[str, list]:
    """{module.param: [its initial hash per rank]}: the parameters a world left out inside its
    per-rank blocks (runner/per_rank.py)."""
    out = {}
    for m in rs.events:
        if isinstance(m.get("per_rank_params"), dict):
            out.update(m["per_rank_params"])
    return out


def per_rank_ops(rs: RecordSet) -> list[str]:
    """The op streams ("phase: module") that world left out because they differed per rank."""
    return next((m["per_rank_ops"] for m in rs.events if isinstance(m.get("per_rank_ops"), list)), [])


def _inside_block(m: dict, blocks: dict) -> bool:
    """A reference record inside a per-rank block that the other world has not (left out, or a module
    only the reference has: TP=1's local_experts.3): not missing there. What both have is compared."""
    mod = m["module"]
    return any(mod.startswith(b + ".") or (mod == b and m["kind"] == "op") for b in blocks)
