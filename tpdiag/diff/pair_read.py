"""The diff's read of a record pair: both stored tensors, checked against their stored hashes
(records/store.py) - at once where their bytes are equal."""
from __future__ import annotations

import torch

from tpdiag.diff import bits
from tpdiag.records.store import RecordSet


def read_pair(ref: RecordSet, rm: dict, other: RecordSet, om: dict) -> tuple:
    """Both records' stored tensors, each checked against its stored hash - a whole pass over the
    tensor, most of a second pass's diff on the host - except where one check answers for both:
    both index hashes hold the same lanes (one lane mix) and the two tensors' flat bytes are
    equal. Then each file's check passes exactly when the other's does, and the reference's is
    made (once per reference record, whatever the degrees): an edit of one file makes the bytes
    differ and both are checked; the same edit of both fails the reference's check. Equal lanes
    with other shapes: a stack of row shards [world, n/world, ...] (TP=2's column-parallel
    weights, their grads, the embedding) and the reference's whole [n, ...], the same bytes in
    the same order."""
    rt, ot = ref.tensor(rm, verify=False), other.tensor(om, verify=False)
    if ref.checked_before(rm) and other.checked_before(om):
        # both stored tensors checked already by this compare (the region diff's pair, read again
        # by the own-input diff: records/checked.py): the same bytes of the same files
        ref.vouch(rm)
        other.vouch(om)
    elif same_stored_bytes(ref, rm, rt, other, om, ot):
        # not neither: two files edited alike stay equal (a record both sides hold, then bounds
        # read from it); the reference's check fails them
        ref.verify(rm, rt)
        other.vouch(om)
    else:
        ref.verify(rm, rt)
        other.verify(om, ot)
    return rt, ot


def same_stored_bytes(ref: RecordSet, rm: dict, rt: torch.Tensor, other: RecordSet, om: dict,
                      ot: torch.Tensor) -> bool:
    """Whether the two stored tensors' checks stand or fall together: their flat bytes equal and
    their index hashes' lanes equal (records/hashing.lanes_of)."""
    from tpdiag.records.hashing import lanes_of

    h, g = rm.get("stored_hash"), om.get("stored_hash")
    if h is None or g is None or ref.hash_version != other.hash_version or not ref.known_hashes():
        return False
    if rt.dtype != ot.dtype or rt.numel() != ot.numel():
        return False
    if h != g:
        try:
            if rt.shape == ot.shape or lanes_of(h, rm["dtype"], rt.shape) != lanes_of(g, om["dtype"], ot.shape):
                return False
        except (TypeError, ValueError):  # an index hash that is no hash: each side's own check refuses it
            return False
    if rt.shape == ot.shape:
        return bits.bitwise_equal(rt, ot)
    return torch.equal(bits.raw_bits(rt).reshape(-1), bits.raw_bits(ot).reshape(-1))
