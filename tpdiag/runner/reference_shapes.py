"""What a rank reads from its reference world's index before its step: the whole shape of each
record (where hash mode places an unmarked shard; what tells a piece's slice of the batch or the
sequence from a value every piece shares) and the per-rank parameters' reference values.
"""
from __future__ import annotations


def _reference_params(cfg):
    from tpdiag.runner.per_rank import reference_params

    return reference_params(cfg.ref_dir)


def _ref_shapes(cfg, world: int) -> dict:
    """Whole shapes of the reference's records, when it ran at TP=1: where hash mode places an
    unmarked shard (a plain local tensor) in the whole tensor."""
    if world == 1 or not cfg.ref_dir or cfg.capture == "full":
        return {}
    try:
        from tpdiag.records.store import read_index

        world_meta, events = read_index(cfg.ref_dir)
        if world_meta.get("degree") != 1:
            return {}
        return {m["key"]: m.get("full_shape") or m["local_shape"] for m in events}
    except Exception:  # a failed or missing reference: DTensor placements still place shards
        return {}


def _piece_ref(cfg) -> dict:
    """A micro-batched or decode world: the reference's whole shape per record key, which tells
    a piece's slice of the batch (or of the sequence) from a value every piece shares
    (probes/pieces.py)."""
    if not (cfg.micro_batch or cfg.mode == "decode") or not cfg.ref_dir:
        return {}
    try:
        from tpdiag.records.store import read_index

        _, events = read_index(cfg.ref_dir)
    except Exception:  # a failed reference: the pieces are merged by their own shapes
        return {}
    out = {}
    for m in events:
        shape = m.get("full_shape") or m.get("local_shape")
        if shape:
            out[m["key"]] = list(shape)
    return out
