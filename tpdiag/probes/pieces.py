"""A micro-batched or decoded step's records made whole: each piece's record is a slice of the
reference's - along the batch (dim 0) for a micro-batch, along the sequence for a decode call
(positions [start, stop)) - or a per-call value every piece shares (RoPE tables at micro-batches),
or a running sum (a parameter's grad accumulates over the pieces: its last record is the step's).

Full capture concatenates the pieces' slices in order. Hash capture hashes each slice as a shard
of the whole at its offset (the lanes are order-aware, like a TP shard's) and merging is the
lanes' sum (take_lanes of a tuple of rows), so no piece is kept. Records are then put in the
reference's order (step, phase, first seen) and renumbered: locate walks them in that order.
"""
from __future__ import annotations

import torch

PHASE_RANK = {"init": 0, "forward": 1, "loss": 2, "backward": 3, "optimizer": 4}


def place(rec, key: str, local, shape=None):
    """Where a piece's record sits in the whole: (dim, offset, whole size), or None for a value
    that is not a slice (the same per-call value in every piece, or a decode call's own).

    A micro-batch is a slice along dim 0: the reference's dim 0 says (n pieces of it); without a
    reference record, any tensor with a dim 0 is. A decode call is positions [start, stop) of
    the sequence: the dim where this record is stop - start wide and the reference's is the whole
    sequence, every other dim the reference's (a module's [B, S, D] output: dim 1; RoPE's [S, D]
    table: dim 0)."""
    if local.ndim == 0:
        return None
    ref = rec.piece_ref.get(key)
    if rec.piece_span is None:
        whole = ref[0] if ref else None
        if whole is None or whole == local.shape[0] * rec.n_pieces or whole != local.shape[0]:
            return 0, rec.piece * local.shape[0], local.shape[0] * rec.n_pieces
        return None
    start, stop, total = rec.piece_span
    if not ref or len(ref) != local.ndim:
        return None
    # shape: the record's whole shape where it knows it (a DTensor's global shape at TP > 1); a
    # plain local shard is a TP-th of the reference along its shard dim
    shape = list(shape if shape is not None else local.shape)
    w = rec.world
    for d in range(local.ndim):
        if shape[d] == stop - start and ref[d] == total and \
                all(shape[i] == ref[i] or shape[i] * w == ref[i] for i in range(local.ndim) if i != d):
            return d, start, total
    return None


def hash_piece(rec, meta: dict, t, local):
    """Recorder.add of a hash-mode record inside a piece (TP=1: a whole plain tensor)."""
    shape = list(local.shape)
    where = place(rec, meta["key"], local)
    if where is not None:
        d, offset, whole = where
        full = shape[:d] + [whole] + shape[d + 1:]
        meta["piece_dim"] = d
        slot = rec._hash(local, d, whole, offset, t)
    else:
        full, meta["piece_const"] = shape, True
        slot = rec._hash(local, None, None, 0, t)
    meta["hash_layout"], meta["full_shape"] = "replicate", full
    rec.lanes.append(slot)
    rec._rows.append((meta, None))
    return meta


def merge(rec) -> None:
    """rec's records with every piece's records merged into the whole step's, in place."""
    from tpdiag.probes.stream import finish

    records = rec.records
    lanes = list(rec.lanes)
    if not any("piece" in m for m, _ in records):
        return
    finish(records)  # full capture: every piece's host copy complete, its hash known
    groups: dict[str, list[int]] = {}
    for i, (m, _) in enumerate(records):
        if "piece" in m:
            groups.setdefault(m["key"], []).append(i)
    out = []  # (sort key, meta, tensor, lane)
    for i, (m, t) in enumerate(records):
        if "piece" not in m:
            out.append(((m["step"], PHASE_RANK.get(m["phase"], 5), i), m, t, lanes[i]))
            continue
        members = groups.get(m["key"])
        if members is None or members[0] != i:
            continue  # merged with its key's first piece
        if m["kind"] == "param_grad":  # accumulated in place over the pieces: the last is the step's
            j = members[-1]
            mm = {k: v for k, v in records[j][0].items() if k != "piece"}
            out.append(((m["step"], PHASE_RANK["backward"], j), mm, records[j][1], lanes[j]))
            continue
        for meta, tensor, lane in _merged(rec, [records[j] for j in members], [lanes[j] for j in members]):
            out.append(((m["step"], PHASE_RANK.get(m["phase"], 5), i), meta, tensor, lane))
    out.sort(key=lambda x: x[0])
    rec._records[:] = []
    rec.lanes[:] = []
    for n, (_, m, t, lane) in enumerate(out):
        m["idx"] = n
        rec._records.append((m, t))
        rec.lanes.append(lane)


def _merged(rec, parts: list, lanes: list) -> list:
    """[(meta, tensor, lane)] for one key's piece records."""
    m0 = {k: v for k, v in parts[0][0].items() if k not in ("piece", "piece_const")}
    consumers = sorted({c for m, _ in parts for c in m.get("consumers", ())})
    if consumers:
        m0["consumers"] = consumers
    if parts[0][1] is None:  # hash capture: the slices' lanes add up to the whole's
        if parts[0][0].get("piece_const"):
            return [(m0, None, lanes[0])]
        return [(m0, None, tuple(lanes))]
    from tpdiag.probes.stream import as_tensor

    ts = [as_tensor(t) for _, t in parts]
    same = all(x.shape == ts[0].shape and x.dtype == ts[0].dtype for x in ts) and all(
        torch.equal(_bits(x), _bits(ts[0])) for x in ts[1:])
    whole = rec.piece_ref.get(m0["key"])
    d = parts[0][0].get("piece_dim", 0)
    whole_d = whole[d] if whole and d is not None and d < len(whole) else None
    if ts[0].ndim and d is not None and (whole_d == sum(x.shape[d] for x in ts) or (whole is None and not same)):
        t = torch.cat(ts, d)
    elif same:
        t = ts[0]  # the same per-call value in every piece
    else:
        # neither a slice of the whole nor shared: each piece's own (unmatched at the reference)
        return [({**m0, "name": f"{m0['name']}.piece{k}", "key": f"{m0['key']}.piece{k}",
                  "hash": _hash(x) if rec.hash else None}, x, None) for k, x in enumerate(ts)]
    m0["local_shape"] = list(t.shape)
    if rec.hash:
        # the hash of exactly this tensor: gather stores it as is and need not hash it again
        m0["hash"], m0["_hash_is_tensor"] = _hash(t), True
    return [(m0, t, None)]


def _hash(t):
    """tensor_hash of a host tensor, on the world's GPU when it has one: the record-hash kernel
    gives the CPU path's bits (benchmarks record-hash), and a micro-batched region pass merges
    GBs (llama-1b 8 x 4096 on an H100: its mb=1 world took 47 s against the reference's 18 s)."""
    from tpdiag.records.hashing import tensor_hash

    if t.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return tensor_hash(t.to(torch.cuda.current_device()))
    return tensor_hash(t)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
