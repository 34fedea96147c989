"""Full capture off the device: each record's tensor streamed to host memory (a HostStore,
probes/host_store.py: chunks spilled to disk past a host-memory budget).

Why a copy issued in stream order is enough: the copy is queued on the device's current stream
when the record is made, so it reads the value before any later kernel on that stream (an in-place
activation, gradient clipping, the optimizer) can change it - no device clone, nothing extra kept
alive on the device. On a CUDA device the destination is pinned host memory and the copy is
asynchronous (the host does not wait); on the CPU (gloo, CI) the copy is a plain clone.
"""
from __future__ import annotations

import torch

from tpdiag.probes.host_store import Captured, HostStore


def as_tensor(t):
    """A record's tensor as a torch.Tensor (a Captured is read back); None stays None."""
    return t.get() if isinstance(t, Captured) else t


def finish(records) -> list:
    """Completes every HostStore behind `records` and fills each full-mode record's meta['hash']
    (its local shard's hash) from lanes computed on the device at record time: one host sync
    for all of them. Returns the stores."""
    from tpdiag.records.hashing import hash_of_lanes

    stores, todo = {}, []
    for m, t in records:
        if isinstance(t, Captured):
            stores[id(t.store)] = t.store
            if "hash" in m and m["hash"] is None and t.lanes is not None:
                todo.append((m, t))
    for s in stores.values():
        s.finish()
    if todo:
        uniq = {id(t.lanes): t.lanes for _, t in todo}
        by_dev: dict = {}
        for k, v in uniq.items():
            by_dev.setdefault(v.device, []).append(k)
        got = {}
        for keys in by_dev.values():  # one host sync per device
            got.update(zip(keys, torch.stack([uniq[k][:2] for k in keys]).cpu().tolist()))
        for m, t in todo:
            a, b = got[id(t.lanes)]
            m["hash"] = hash_of_lanes(int(a), int(b), str(t.dtype), t.shape)
    return list(stores.values())


def record_full(rec, meta: dict, t, local) -> dict:
    """Recorder.add in full mode, once the record's meta is built: its tensor streamed to the
    host (t: what was recorded, local: its detached local shard)."""
    # a decode call's piece is concatenated with the others and the whole hashed at the merge
    # (probes/pieces.py): its own lanes would be a hash launch a record a call, never read
    lanes = rec.hash and rec.piece_span is None
    if rec.hash:
        meta["hash"] = None  # this rank's shard; filled by finish() (lanes computed now)
    store = rec.host_store
    if store is None:
        store = rec.host_store = HostStore(local.device, spill_dir=rec.spill_dir)
    # the copy's and the hash's own torch ops are not records (op probe)
    rec.enabled = False
    try:
        cap = store.put(local, t, lanes=lanes)
    finally:
        rec.enabled = True
    rec.lanes.append(None)
    rec.records.append((meta, cap))
    return meta


def close_stores(*record_lists) -> None:
    """Close every HostStore behind these (meta, tensor) lists: spill files and chunks go."""
    stores = {}
    for records in record_lists:
        for _, t in records:
            if isinstance(t, Captured):
                stores[id(t.store)] = t.store
    for s in stores.values():
        s.close()
