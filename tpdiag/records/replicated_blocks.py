"""Shards of a tensor whose blocks are replicated on several ranks: KV heads where TP exceeds their
count (vLLM's num_kv_head_replicas: 2 KV heads at TP=4, rank r holds head r // 2). Each rank holds
one block of the whole; the n shards hold every block TP / blocks times. Gathering them as shards
(n blocks) or as padding would compare a tensor twice the reference's, so each block is taken once,
and its copies on the other ranks are checked against it as a replica's are."""
from __future__ import annotations

import torch


def replicated_dim(local: list[int], full: list[int], n: int) -> tuple[int, int] | None:
    """(dim, ranks per block) where exactly one dim shrank to a whole block of the reference's
    (full / local blocks) and the blocks divide the n ranks more than once; else None. Plain
    shards (local * n == full) and padded ones (records/layout.padded_dim: n copies less than twice
    the whole) never match."""
    if len(local) != len(full):
        return None
    dims = [d for d in range(len(full)) if local[d] != full[d]]
    if len(dims) != 1:
        return None
    d = dims[0]
    k, f = local[d], full[d]
    if k <= 0 or k >= f or f % k:
        return None
    blocks = f // k
    if n % blocks or n // blocks < 2:
        return None
    return d, n // blocks


def _orders(n: int, reps: int) -> list[list[list[int]]]:
    """The ranks of each block, block order: neighbouring ranks (vLLM's r // replicas) first, then
    round-robin (r % blocks)."""
    blocks = n // reps
    return [[list(range(b * reps, (b + 1) * reps)) for b in range(blocks)],
            [list(range(b, n, blocks)) for b in range(blocks)]]


def gather(shards: list[torch.Tensor], d: int, reps: int):
    """(whole, copies, consistent): the whole tensor with each block taken once; copies: `reps`
    whole tensors, the j-th of every block's j-th holder (what a replica's copies are, so a
    replica's checks apply: the spread, copies that add up to the reference); consistent: whether
    every block's holders hold the same bits. The holders are the neighbouring ranks unless only
    the round-robin assignment makes them agree."""
    n = len(shards)
    groups = None
    for order in _orders(n, reps):
        if all(torch.equal(shards[g[0]], shards[r]) for g in order for r in g[1:]):
            groups = order
            break
    consistent = groups is not None
    groups = groups or _orders(n, reps)[0]
    copies = [torch.cat([shards[g[j]] for g in groups], dim=d) for j in range(reps)]
    return copies[0], copies, consistent
