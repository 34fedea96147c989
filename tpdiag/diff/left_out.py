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


# the reasons (diff/partials.py) that say the ranks' copies were read whole and found to be shares of
# one value (a sum, a max, statistics combined) - no difference at all
SHARE_WHYS = ("unreduced partial", "the ranks' own values")

# a few of the module records left uncompared, by key, in summary.json (a deep model has hundreds
# of op records so left: counted by reason, not listed)
MAX_NOT_COMPARED_KEYS = 20


def not_compared(dd) -> dict | None:
    """What this degree recorded but did not compare with the reference, and why (diff/engine.py,
    diff/partials.py): unreduced partial sums (each rank's share), collectives before their wait,
    ops only one degree ran... Their values are evidence neither way, so the verdict says they
    exist: {records, ops, why: {reason: count}, module_records: [key, ...]}; None if none."""
    left = list(getattr(dd, "uncompared", None) or ())
    if not left:
        return None
    why: dict[str, int] = {}
    for m in left:
        # the reason's kind, without the record-specific detail after it
        w = str(m.get("why") or "unknown").split(" (")[0].split(":")[0].strip()
        why[w] = why.get(w, 0) + 1
    modules = sorted({m["key"] for m in left if m.get("kind") != "op" and m.get("key")})
    # the module records whose whole values showed each rank's copy to be its share of a value the
    # module makes one on every rank (diff/partials.py): a hash-first pass cannot tell such shares
    # from wrong ones, and its verdict on them yields to these (runner/drill.py)
    shares = sorted({m["key"] for m in left if m.get("kind") != "op" and m.get("key")
                     and str(m.get("why") or "").startswith(SHARE_WHYS)})
    return {"records": len(left), "ops": sum(m.get("kind") == "op" for m in left),
            **({"shares": shares} if shares else {}),
            "why": dict(sorted(why.items(), key=lambda kv: -kv[1])),
            "module_records": modules[:MAX_NOT_COMPARED_KEYS],
            **({"module_records_more": len(modules) - MAX_NOT_COMPARED_KEYS} if len(modules) > MAX_NOT_COMPARED_KEYS else {})}
