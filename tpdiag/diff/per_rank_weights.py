"""Whether the weights a per-rank block holds at a degree are the reference's own, placed per rank
(diff/analyse.py): an expert-parallel MoE's experts compared at the block's boundary only, their
parameters by hash against the reference's."""
from __future__ import annotations

from tpdiag.diff.judge import describe
from tpdiag.diff.left_out import per_rank_blocks, per_rank_params
from tpdiag.records.store import RecordSet


def not_the_references(entry: dict, ref: RecordSet, other: RecordSet, label: str, rows: list[dict]) -> None:
    """A parameter left out inside a per-rank block must be, on every rank, one of the reference's
    own (another expert's weights under this rank's name); weights no reference parameter has are
    not expert placement but a model that differs from the reference's (experts seeded per rank).
    Said at the block's output record (its parameters are not in diff.csv): on the finding there,
    or as a rank-inconsistent-replica finding of its own where that record is no finding."""
    # a hash-capture reference's parameters have their whole hash as full_hash (at TP=1 the lanes of
    # the one tensor: the same function as each rank's hash of its own whole expert)
    known = {m.get(k) for m in ref.events if m["kind"] == "param_init" for k in ("hash", "full_hash")} - {None}
    params = per_rank_params(other)
    for name, hashes in params.items():
        bad = [r for r, h in enumerate(hashes) if h is not None and h not in known]
        if not bad:
            continue
        block = next((b for b in per_rank_blocks(other) if name.startswith(b + ".")), None)
        if block is None:
            continue
        stale = _unhashed_inside(ref, block)
        if stale and len(_unknown_in(params, block, known)) <= len(stale):
            # the reference's own copy may be the one whose hash it never took: no evidence either way
            # (the block's boundary is still compared; a false BUG here named a correct placement).
            # Each unhashed parameter is at most one weight: more distinct unknown weights than
            # unhashed parameters are, some of them, none of the reference's whatever those were
            entry["per_rank"][block]["weights_unchecked"] = (
                f"{name} on rank {', '.join(map(str, bad))} of TP={label} matches none of the reference's hashed "
                f"parameters, but the reference's {stale[0]} changed in place before it was hashed: whether "
                "this degree's per-rank weights are the reference's is not known")
            continue
        why = (f"{name} on rank {', '.join(map(str, bad))} of TP={label} is none of the reference's parameters: "
               "the per-rank modules inside this block are not the reference's modules placed per rank (as experts "
               "seeded per rank) - this degree does not run the reference's model")
        # said (and gated: gate/degree.py) whether or not the block's output has a row to hang it on
        entry["per_rank"][block]["not_the_reference"] = why
        row = next((r for r in rows if r["module"] == block and r["kind"] == "out" and r["phase"] == "forward"), None)
        if row is None:
            return
        fd = entry.get("first_divergence") or {}
        hit = next((f for f in entry["findings"] + [fd] if f.get("key") == row["key"]), None)
        if hit is not None:
            hit["per_rank_weights"] = why
            return
        f = describe(row, {"phase": "forward", "module": block, "op": None, "kind": "out", "name": row["name"],
                           "step": row["step"], "cause": None, "max_abs": row.get("max_abs"), "bound": row.get("bound"),
                           "key": row["key"], "detail": why}, not_reference=why)
        entry["findings"].insert(0, f)
        entry["status"] = "divergent"
        return


def _unhashed_inside(ref: RecordSet, block: str) -> list[str]:
    """The reference's parameters inside `block` that have no hash (changed in place between their
    record and their queued hash: kernels/hash_buffer.py STALE)."""
    return [f"{m['module']}.{m['name']}" for m in ref.events
            if m["kind"] == "param_init" and m["module"].startswith(block + ".") and m.get("hash_layout") == "stale"]


def _unknown_in(params: dict, block: str, known: set) -> set:
    """The distinct per-rank weight hashes inside `block` that are none of the reference's hashed ones."""
    return {h for name, hashes in params.items() if name.startswith(block + ".")
            for h in hashes if h is not None and h not in known}
