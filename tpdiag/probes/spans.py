"""A decode call's records, planned once per key: the fast path of Recorder.add in a decode world
under hash capture, for plain tensors (most of its records: ~450 a call, 1,025 calls at 1 x 2048).

pieces.hash_piece's answer for a record - where the call's slice sits in the reference's whole
tensor (the positions, the fold of B sequences' rows, a TP shard's columns) and how it is hashed
- is the same every call for the same key and shapes, but for the position: each hashed offset is
linear in the call's first position. So it is planned once (rec.piece_plans), and each call
queues the tensor at its offsets (HashBuffer.add_span: the launch row cached without the offset).
The key's first call keeps a compact row (probes/rows.py) with the piece's fields; its lane is the
list every later call's slots join, which merge takes as the pieces' lanes in order. Anything the
plan does not cover (not a slice of the whole, a partial sum, a shard whose place is unknown, a
DTensor) goes to hash_piece, and so does every later call of its key (pieces._GENERAL).
"""
from __future__ import annotations

import math
import weakref

import torch

from tpdiag.probes.pieces import _GENERAL, _tp_shard, place
from tpdiag.records.keys import record_key


def add_span(rec, kind: str, module: str, name: str, t, call: int, phase: str, layout, style, cls):
    """Recorder.add of a decode call's plain-tensor record in hash mode: the row (a list), or
    False where the general path must run."""
    start, stop, total = rec.piece_span
    shape = t.shape
    step = rec.step
    pk = (step, phase, module, kind, call, name, shape, t.dtype, stop - start, total, layout)
    plan = rec.piece_plans.get(pk)
    if plan is None:
        plan = rec.piece_plans[pk] = _plan(rec, pk, t, layout)
    if plan is False:
        return False  # hash_piece files it, and every later call of its key (_GENERAL)
    geometry, jobs, extra0, cell = plan
    acc = cell[0]
    if acc is _GENERAL or not t.is_contiguous():  # (planned on a contiguous call: views below)
        return False
    version = t._version
    # a module's input is often another's output: the same tensor, unchanged, at the same place
    # in the same piece is hashed once (its rows shared), as in hash_piece
    here = (rec.piece, version, geometry)
    seen = rec._piece_hashed.get(id(t))
    if seen is not None and seen[1] == here and seen[0]() is t:
        slot = seen[2]
    else:
        hb = rec.hashbuf
        if hb is None:
            from tpdiag.kernels.hash_buffer import HashBuffer

            hb = rec.hashbuf = HashBuffer(t.device)
        rec.enabled = False  # the hash's own torch ops are not records (op probe)
        try:
            if len(jobs) == 1:
                vshape, i, hdim, hfull, c0, c1 = jobs[0]
                x = t if vshape is None else t.view(vshape)
                slot = hb.add_span(x if i is None else x[i], hdim, hfull, c0 + c1 * start, version)
            else:  # one row per sequence (a piece that is also a TP shard, batch > 1)
                slot = tuple(hb.add_span(t.view(vshape)[i], hdim, hfull, c0 + c1 * start, version)
                             for vshape, i, hdim, hfull, c0, c1 in jobs)
        finally:
            rec.enabled = True
        rec._piece_hashed[id(t)] = (weakref.ref(t), here, slot)
    if acc is not None:
        if type(slot) is tuple:
            acc[1].extend(slot)
        else:
            acc[1].append(slot)
        return acc[0]
    extra = dict(extra0, piece=rec.piece)
    extra["full_shape"] = list(extra0["full_shape"])
    row = [step, phase, module, kind, call, name, layout, style, cls, t.dtype, shape, extra]
    slots = list(slot) if type(slot) is tuple else [slot]
    cell[0] = (row, slots)
    rec.lanes.append(slots)
    rec._rows.append(row)
    return row


def _plan(rec, pk: tuple, t, layout):
    """add_span's plan for one key and shapes: (geometry, hash jobs, the row's piece fields, the
    key's cell), or False. A job (view shape, row index, hashed dim, its whole size, c0, c1)
    hashes t (viewed, indexed) at offset c0 + c1 x the call's first position - hash_piece's and
    _hash_placed's arithmetic with the position left open. geometry: a number per distinct
    (whole shape, jobs), equal for equal places. The cell (one per key, whatever the shapes: the
    prompt call's and the one-token calls' plans share it) holds the key's row and slots while the
    calls run (Recorder.end_pieces empties it)."""
    if t.ndim == 0 or not t.is_contiguous():
        return False
    step, phase, module, kind, call, name = pk[:6]
    key = record_key(step, phase, module, kind, call, name)
    where = place(rec, key, t, list(t.shape))
    if where is None:
        return False
    d, _, total, rows = where
    tp = _tp_shard(rec, {"placement": layout, "key": key}, t, t, d)
    if tp == "unknown" or (tp is not None and rows > 1):
        return False
    full = list(t.shape)
    full[d] = total * rows
    extra = {"piece_dim": d}
    if rows > 1:
        extra["piece_fold"] = rows
    if tp is None:
        extra["hash_layout"] = "replicate"
        if rows == 1:
            jobs = ((None, None, d, total, 0, 1),)
        else:
            # [B * positions, ...] hashed as its [B, positions, ...] view at `start` of [B, total, ...]
            vshape = torch.Size((*t.shape[:d], rows, t.shape[d] // rows, *t.shape[d + 1:]))
            jobs = ((vshape, None, d + 1, total, 0, 1),)
    else:
        full[tp[0]] = tp[1]
        extra["hash_layout"] = f"shard:{tp[0]}"
        jobs = _two_dims(t, full, d, tp)
    extra["full_shape"] = full
    geometry = rec.piece_geoms.setdefault((tuple(full), jobs), len(rec.piece_geoms))
    return geometry, jobs, extra, rec.span_rows.setdefault(pk[:6], [None])


def _two_dims(t, full: list, d: int, tp: tuple) -> tuple:
    """_hash_placed's jobs for a piece along dim d that is also a TP shard along tp[0]: the outer
    dim's offset folds into the inner's (in units of the inner dim's row), one job per index of
    the dims before the outer one; the position is the offset of dim d."""
    (outer, o_off), (inner, i_off) = sorted(((d, None), (tp[0], tp[2])))
    per_outer = math.prod(full[outer + 1:inner + 1])
    nrows = math.prod(t.shape[:outer])

    def offset(start: int, i: int) -> int:
        oo = start if o_off is None else o_off
        ii = start if i_off is None else i_off
        return ii + (oo + i * full[outer]) * per_outer

    if nrows == 1:
        return ((None, None, inner, full[inner], offset(0, 0), offset(1, 0) - offset(0, 0)),)
    vshape = torch.Size((nrows, *t.shape[outer:]))
    return tuple((vshape, i, inner - outer, full[inner], offset(0, i), offset(1, i) - offset(0, i))
                 for i in range(nrows))
