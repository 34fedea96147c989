"""A micro-batched or decoded step's pieces placed in the whole: each piece's record is a slice of the
reference's - along the batch (dim 0) for a micro-batch, along the sequence for a decode call
(positions [start, stop)) - or a per-call value every piece shares (RoPE tables at micro-batches),
or a running sum (a parameter's grad accumulates over the pieces: its last record is the step's).

Full capture concatenates the pieces' slices in order. Hash capture hashes each slice as a shard
of the whole at its offset (the lanes are order-aware, like a TP shard's) and merging is the
lanes' sum (take_lanes of a tuple of rows), so no piece is kept. Records are then put in the
reference's order (step, phase, first seen) and renumbered: locate walks them in that order
(the merge: probes/piece_merge.py).
"""
from __future__ import annotations

import math
import weakref

import torch

def place(rec, key: str, local, shape=None):
    """Where a piece's record sits in the whole: (dim, offset, whole size, rows), or None for a
    value that is not a slice (the same per-call value in every piece, or a decode call's own).
    rows > 1: the dim holds `rows` sequences' runs flat (below); the whole is rows x whole size.

    A micro-batch is a slice along dim 0: the reference's dim 0 says (n pieces of it); without a
    reference record, any tensor with a dim 0 is. A decode call is positions [start, stop) of
    the sequence: the dim where this record is stop - start wide and the reference's is the whole
    sequence, every other dim the reference's (a module's [B, S, D] output: dim 1; RoPE's [S, D]
    table: dim 0)."""
    if local.ndim == 0:
        return None
    ref = rec.piece_ref.get(key)
    if rec.piece_span is None:
        # dim 0 of the record's whole shape where it is known (a DTensor's global shape: a weight
        # grad's rows sharded TP ways are no batch slice even when TP = the number of pieces)
        n0 = shape[0] if shape is not None and len(shape) else local.shape[0]
        whole = ref[0] if ref else None
        if whole is None or whole == n0 * rec.n_pieces or whole != n0:
            return 0, rec.piece * n0, n0 * rec.n_pieces, 1
        return None
    start, stop, total = rec.piece_span
    if not ref or len(ref) != local.ndim:
        return None
    # a decode world asks this for ~450 records a call, the same ones every call: the answer
    # depends on the key (its reference shape), the shapes and the span's width and total only
    memo = (key, local.shape, None if shape is None else tuple(shape), stop - start, total)
    hit = rec.piece_memo.get(memo, _UNSET)
    if hit is not _UNSET:
        return None if hit is None else (hit[0], start, total, hit[1])
    where = _place_span(rec, ref, local, shape, start, stop, total)
    rec.piece_memo[memo] = None if where is None else (where[0], where[3])
    return where


_UNSET = object()


def _place_span(rec, ref, local, shape, start, stop, total):
    # a run of the first positions only (runner/prefix.py): the pieces cover [0, total) of the
    # reference's whole sequence - or of its record cut to those positions
    wholes = (total,) if rec.piece_whole is None else (total, rec.piece_whole)
    # shape: the record's whole shape where it knows it (a DTensor's global shape at TP > 1); a
    # plain local shard is a TP-th of the reference along its shard dim
    shape = list(shape if shape is not None else local.shape)
    w = rec.world
    def others(d):
        return all(shape[i] == ref[i] or shape[i] * w == ref[i] for i in range(local.ndim) if i != d)

    for d in range(local.ndim):
        if shape[d] == stop - start and ref[d] in wholes and others(d):
            return d, start, total, 1
    # a linear's mm at batch B > 1 sees [B * positions, N], the reference [B * total, N]: each
    # sequence's rows of this call, at its own position - [B, total, N] viewed flat (dim, offset,
    # total, B); the lanes' index is the flat one either way
    for d in range(local.ndim):
        for whole in wholes:
            rows, left = divmod(ref[d], whole)
            if not left and rows > 1 and shape[d] == rows * (stop - start) and others(d):
                return d, start, total, rows
    return None


def grows(rec, key: str, local) -> bool:
    """A decode call's record that is no slice of the whole and changed shape since the call
    before (a KV cache's concatenation, the scores over the keys so far): it is never the
    reference's, nor one value every call shares, and together such records grow with the
    sequence squared (llama-1b 1 x 2048 on an H100: 6.7 GB captured in a region pass's decode
    world, 86 s of diff). The first call's is kept; the key is marked so merge names what was kept
    per call (unmatched), and the rest is counted."""
    shape = tuple(local.shape)
    prev = rec.piece_shapes.get(key)
    rec.piece_shapes[key] = shape
    if key not in rec.piece_varying and (prev is None or prev == shape):
        return False
    rec.piece_varying[key] = rec.piece_varying.get(key, 0) + 1
    return True


def hash_piece(rec, meta: dict, t, local):
    """Recorder.add of a hash-mode record inside a piece. At TP > 1 the piece may also be a TP
    shard (a column-parallel output, a sharded weight's grad): both offsets go into its lanes."""
    shape = list(local.shape)
    if rec.piece_span is not None:  # spans.add_span leaves this key to us from now on
        rec.span_rows.setdefault((meta["step"], meta["phase"], meta["module"], meta["kind"], meta["call"],
                                  meta["name"]), [None])[0] = _GENERAL
    # a weight's grad accumulates over the pieces: never a slice of the batch (at TP > 1 a shard
    # of TP-th the height could pass for one when TP = the number of micro-batches)
    where = None if meta["kind"] == "param_grad" else place(rec, meta["key"], local, list(t.shape))
    if where is None and meta["kind"] != "param_grad" and rec.piece_span is not None \
            and grows(rec, meta["key"], local):
        return None  # left out from its first change on, as in full capture
    label = meta.get("placement") or ""
    if where is None and label.startswith("strided:") and rec.world > 1:
        # a packed gate/up weight's grad (no batch slice): one row per chunk, as outside pieces
        meta["piece_const"] = True
        meta["hash_layout"], meta["full_shape"] = label, list(t.shape)
        rec.lanes.append(rec._hash_strided(t, local, label))
        rec._rows.append((meta, None))
        return meta
    tp = _tp_shard(rec, meta, t, local, where[0] if where is not None else None)
    if where is not None and where[3] > 1 and tp is not None:
        tp = "unknown"  # a folded piece that is also a TP shard: not placed (per-rank hashes)
    if tp == "unknown":
        # a shard whose place in the whole is not known (a partial sum, a strided shard): per-rank
        # hashes only, as for such a record outside pieces (runner/gather.py)
        meta["piece_const"] = True
        meta["hash_layout"], meta["full_shape"] = "unknown", shape
        slot = rec._hash(local, None, None, 0, t)
    else:
        full = list(shape)
        if where is not None:
            full[where[0]] = where[2] * where[3]
        if tp is not None:
            full[tp[0]] = tp[1]
        if where is None:
            meta["piece_const"] = True
        else:
            meta["piece_dim"] = where[0]
            if where[3] > 1:
                meta["piece_fold"] = where[3]
        meta["hash_layout"] = f"shard:{tp[0]}" if tp is not None else "replicate"
        meta["full_shape"] = full
        if where is not None and where[3] > 1:
            # hashed as its [B, positions, ...] view at `start` of [B, total, ...]
            d, rows = where[0], where[3]
            local = local.unflatten(d, (rows, -1))
            full = full[:d] + [rows, where[2]] + full[d + 1:]
            where = (d + 1, where[1], where[2], 1)
        # a module's input is often another's output (wq, wk and wv read one tensor): the same
        # tensor, unchanged, at the same place in the same piece is hashed once (its row shared)
        versions = (t._version, local._version)
        place_key = (rec.piece, versions, tuple(full), where, tp)
        seen = rec._piece_hashed.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == place_key:
            slot = seen[2]
        else:
            slot = _hash_placed(rec, local, t, full, where, tp)
            rec._piece_hashed[id(t)] = (weakref.ref(t), place_key, slot)
    rec.lanes.append(slot)
    rec._rows.append((meta, None))
    return meta


# a key's cell in rec.span_rows once the general path (hash_piece) has filed one of its calls:
# its later calls go there too, so a key's records are all span rows (probes/spans.py) or all the
# general path's - merge's per-call values (piece_const) never meet a span row's list of slots
_GENERAL = ("general",)


def _tp_shard(rec, meta: dict, t, local, piece_dim):
    """(dim, whole size, offset) of the TP shard a piece's record is, None when it is replicated,
    'unknown' when its place cannot be told."""
    if rec.world == 1:
        return None
    label = meta.get("placement")
    if label is not None:  # a DTensor (or a layout its caller gave): the placement says
        if label.startswith("shard:"):
            _, _, d, size, offset = rec._hash_layout(t, local, meta["key"], label)
            return (d, size, offset) if d != piece_dim else "unknown"
        return None if label.startswith("replicate") else "unknown"
    # a plain tensor: a dim that is a TP-th of the reference's whole (not the piece's dim)
    ref = rec.piece_ref.get(meta["key"])
    if not ref or len(ref) != local.ndim:
        return None if not ref else "unknown"
    dims = [i for i in range(local.ndim) if i != piece_dim and local.shape[i] != ref[i]]
    if not dims:
        return None
    if len(dims) > 1 or local.shape[dims[0]] * rec.world != ref[dims[0]]:
        return "unknown"
    return dims[0], ref[dims[0]], rec.rank * local.shape[dims[0]]


def _hash_placed(rec, local, t, full: list, where, tp):
    """Hash slot(s) of `local` at its place in the whole tensor of shape `full`: along one dim
    (a piece or a shard), or two (a piece that is also a TP shard). The lanes' global index is
    linear in the offsets, so the outer of two dims folds into the inner dim's offset (in units
    of the inner dim's row): one row per index of the dims before the outer one (the lanes of the
    rows add up, as a strided shard's do)."""
    dims = [(d, off) for d, off in ((where[0], where[1]) if where else (None, 0),
                                    (tp[0], tp[2]) if tp else (None, 0)) if d is not None]
    if not dims:
        return rec._hash(local, None, None, 0, t)
    if len(dims) == 1:
        d, off = dims[0]
        return rec._hash(local, d, full[d], off, t)
    (outer, off_o), (inner, off_i) = sorted(dims)
    per_outer = math.prod(full[outer + 1:inner + 1])  # inner-dim rows per index of the outer dim
    rows = math.prod(local.shape[:outer])
    if rows == 1:
        return rec._hash(local, inner, full[inner], off_i + off_o * per_outer, t)
    sub = local.reshape(rows, *local.shape[outer:])
    return tuple(rec._hash(sub[i], inner - outer, full[inner], off_i + (off_o + i * full[outer]) * per_outer, t)
                 for i in range(rows))
