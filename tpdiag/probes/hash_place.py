"""Where a hash-mode record's shard sits in the whole tensor, and its hash rows.

A record's shard is hashed on the device at its place in the whole tensor (its offset along the
sharded dim), so the lanes of every rank's shards add up to the whole tensor's lanes: a DTensor's
placement says where; a plain local tensor at TP > 1 is placed by the reference's whole shape.
Recorder (probes/recorder.py) takes these methods; pieces.py calls them on it.
"""
from __future__ import annotations


class HashPlacing:
    """Recorder's hashing of one shard: its place, its hash rows (HashBuffer: kernels/hash_buffer.py)."""

    def _hash(self, local, dim, size, offset, owner) -> int:
        if self.hashbuf is None:
            from tpdiag.kernels.hash_buffer import HashBuffer

            self.hashbuf = HashBuffer(local.device)
        # the hash's own torch ops are not records (op probe); no contextmanager: host time
        self.enabled = False
        try:
            return self.hashbuf.add(local, dim, size, offset, owner)
        finally:
            self.enabled = True

    def _hash_strided(self, t, local, layout: str) -> tuple:
        """A _StridedShard holds, along its dim, the rank's chunk of each of `s` blocks: one hash
        row per chunk, each at its own offset in the whole tensor (the lanes add up)."""
        from tpdiag.records.layout import strided_pieces

        _, d, s = layout.split(":")
        d, s = int(d), int(s)
        size, n, r = t.shape[d], t.device_mesh.size(), t.device_mesh.get_local_rank()
        slots, at = [], 0
        for offset, length in strided_pieces(size, n, s, r):
            slots.append(self._hash(local.narrow(d, at, length), d, size, offset, t))
            at += length
        return tuple(slots)

    def _hash_layout(self, t, local, key, p):
        """(layout, whole shape, shard dim, whole size of that dim, this rank's offset);
        p: t's placement label (None for a plain tensor)."""
        shape = list(local.shape)
        if p is not None:  # a DTensor: its placement says where the shard sits
            if p.startswith("shard:"):
                d = int(p.split(":")[1])
                size, n = t.shape[d], t.device_mesh.size()
                chunk = -(-size // n)  # torch.chunk's split, which Shard uses
                offset = min(t.device_mesh.get_local_rank() * chunk, size)
                return p, list(t.shape), d, size, offset
            if p.startswith("strided:"):
                return p, list(t.shape), int(p.split(":")[1]), None, 0  # pieces: _hash_strided
            return p, list(t.shape), None, None, 0
        if self.world == 1:
            return "replicate", shape, None, None, 0
        full = self.ref_shapes.get(key)
        if full is None:
            return "unknown", shape, None, None, 0
        if list(full) == shape:
            return "replicate", shape, None, None, 0
        from tpdiag.records.layout import shard_dim

        d = shard_dim(shape, list(full), self.world)
        if d is None:
            from tpdiag.records.layout import padded_dim

            d = padded_dim(shape, list(full), self.world)
            if d is None:
                from tpdiag.records.replicated_blocks import replicated_dim

                rb = replicated_dim(shape, list(full), self.world)
                if rb is None:
                    return "unknown", shape, None, None, 0
                # a block held by `reps` neighbouring ranks (vLLM's KV head r // reps): hashed at its
                # place in the whole, its copies' lanes composed once (runner/gather._hash_meta)
                d, reps = rb
                return f"replicated:{d}:{reps}", list(full), d, full[d], (self.rank // reps) * shape[d]
            if self.rank * shape[d] >= full[d]:
                return "unknown", shape, None, None, 0
            # a shard of a tensor padded to a multiple of TP (records/layout.py): its rows past
            # the whole are padding, left out of the hash (the caller narrows it: _unpadded)
        return f"shard:{d}", list(full), d, full[d], self.rank * shape[d]


def _unpadded(local, dim, size, offset):
    """local without the rows past the whole tensor's end (a padded shard's padding; a copy, so
    its hash is of the values now), else local itself."""
    if dim is None or offset + local.shape[dim] <= size:
        return local
    return local.narrow(dim, 0, size - offset).contiguous()


def _same(seen, t, version: tuple, where: tuple) -> bool:
    """Whether _hashed's entry `seen` is t's, unchanged: the same object, counters and place. A
    compact entry (Recorder.add's fast path: one counter, the shape) stands for the pair
    (counter, counter) and the place (None, None, 0, shape) of a whole plain tensor."""
    if seen is None or seen[0]() is not t:
        return False
    v, w = seen[1], seen[2]
    if type(v) is int:
        return (v, v) == version and (None, None, 0, list(w)) == where
    return v == version and w == where


def take_lanes(hashbuf, slots: list):
    """hashbuf.take_lanes: a slot may be a tuple of rows (kernels/hash_buffer.py)."""
    return hashbuf.take_lanes(slots)


def is_stale(slot, stale) -> bool:
    """slot: a row or a tuple of rows (take_lanes); stale: the buffer's stale rows."""
    return any(s in stale for s in slot) if isinstance(slot, tuple) else slot in stale
