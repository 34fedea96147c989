"""Rebuild whole tensors from stored shards: DTensor placement first, else the shape ratio.

Hugging Face TP and unplanned modules inside a sharded region (act_fn, q_norm) emit local
shards with no marker; exactly one dimension shrinks by the world size, which identifies it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpdiag.errors import NotComparable, ShortOfWhole
from tpdiag.records.replicated_blocks import gather as replicated_gather, replicated_dim


@dataclass
class Assembled:
    full: torch.Tensor | None    # None when only shard-wise comparison is possible
    shards: list[torch.Tensor] | None
    layout: str                  # replicate | shard:D | partial | stacked
    rank_consistent: bool | None  # None: not a replica, nothing to check


def local_shape(meta: dict) -> list[int]:
    return list(meta["local_shape"])


def full_shape_guess(meta: dict) -> list[int] | None:
    """The full shape when it follows from the record alone, else None."""
    shape = local_shape(meta)
    p, n = meta.get("placement"), meta.get("world", 1)
    if n == 1 or meta.get("stored") == "single" and p in (None, "replicate"):
        return shape
    if p and p.startswith(("shard:", "strided:")):
        d = int(p.split(":")[1])
        shape[d] *= n
        return shape
    if p == "replicate" or (p or "").startswith("partial"):
        return shape
    return None


def strided_pieces(size: int, n: int, s: int, r: int) -> list[tuple[int, int]]:
    """(offset, length) along the dim of rank r's pieces of a _StridedShard(split_factor=s) over
    n ranks: the whole dim is s equal blocks (e.g. gate | up of a packed expert weight) and rank r
    holds the r-th 1/n chunk of each, in block order - what torch's full_tensor() inverts
    (checked against it in a real gloo world: tests/test_placements.py). torch 2.13 refuses a
    size that s * n does not divide, so no uneven rule is guessed here."""
    if size % (s * n):
        raise NotComparable(f"a _StridedShard(split_factor={s}) dim of size {size} over {n} ranks "
                            "is uneven; torch cannot build or gather it either")
    block, chunk = size // s, size // (s * n)
    return [(j * block + r * chunk, chunk) for j in range(s)]


def unstride(shards: list[torch.Tensor], d: int, s: int) -> torch.Tensor:
    """The whole tensor from every rank's _StridedShard local piece, rank order."""
    n = len(shards)
    chunk = shards[0].shape[d] // s
    return torch.cat([sh.narrow(d, j * chunk, chunk) for j in range(s) for sh in shards[:n]], dim=d)


def _strided(p: str) -> tuple[int, int]:
    _, d, s = p.split(":")
    return int(d), int(s)


def _reduce_partial(p: str, shards: list[torch.Tensor], dtype) -> torch.Tensor:
    op = p.partition(":")[2] or "sum"
    if op in ("max", "min"):
        st = torch.stack(shards)
        return st.amax(0) if op == "max" else st.amin(0)
    total = shards[0].to(torch.float64)
    for sh in shards[1:]:
        total = total + sh.to(torch.float64)
    if op == "avg":
        total = total / len(shards)
    elif op != "sum":
        raise NotComparable(f"partial placement with reduce op {op!r} cannot be gathered")
    return total.to(dtype)


def full_shape_from_pair(a: dict, b: dict) -> list[int] | None:
    """Both sides sharded with no marker (a reference at TP > 1, e.g. --tp 4,2): the full shape
    follows when exactly one dimension differs and local * world agrees on both sides."""
    la, lb = local_shape(a), local_shape(b)
    na, nb = a.get("world", 1), b.get("world", 1)
    if len(la) != len(lb) or na == nb:
        return None
    dims = [d for d in range(len(la)) if la[d] != lb[d]]
    if len(dims) == 1 and la[dims[0]] * na == lb[dims[0]] * nb:
        full = list(la)
        full[dims[0]] *= na
        return full
    return None


def shard_dim(local: list[int], full: list[int], n: int) -> int | None:
    if len(local) != len(full):
        return None
    dims = [d for d in range(len(full)) if local[d] != full[d]]
    if len(dims) == 1 and local[dims[0]] * n == full[dims[0]]:
        return dims[0]
    return None


def padded_dim(local: list[int], full: list[int], n: int) -> int | None:
    """The dim of a shard of a tensor padded to a multiple of n (Megatron's vocab padding,
    `make_vocab_size_divisible_by`: ceil(V/n) rows per rank, the padding at the end), else None.
    Every rank holds some of the whole (the padding is less than a shard): shards whose n copies
    are twice the whole or more are replicas - KV heads replicated where TP exceeds their count
    (2 heads at TP=4: rank r holds head r // 2), which cut as padding would read a false difference
    (records/replicated_blocks.py gathers them)."""
    if len(local) != len(full):
        return None
    dims = [d for d in range(len(full)) if local[d] != full[d]]
    if len(dims) != 1:
        return None
    k, f = local[dims[0]], full[dims[0]]
    return dims[0] if k * n > f and k == -(-f // n) and (n - 1) * k < f else None


def _short_of_whole(local: list[int], full: list[int], n: int) -> str:
    """Why no layout gathers it, where the ranks together hold less than the reference's tensor:
    the module ran on part of what the reference's ran on (e.g. sequence-parallel input that the
    plan declares replicated, so each rank computes over its own positions only)."""
    held, whole = n * math.prod(local), math.prod(full)
    if len(local) != len(full) or held >= whole:
        return ""
    dims = [d for d in range(len(full)) if local[d] != full[d]]
    return (f": the {n} ranks hold {held} of its {whole} elements together ({len(dims)} dims "
            f"shrank: {', '.join(f'{d} ({full[d]} -> {local[d]})' for d in dims)}) - at TP={n} this "
            "record covers part of what the reference's covers: an input layout your plan "
            "declares wrongly (a sequence-sharded input taken as replicated: ColwiseParallel's "
            "input_layouts, PrepareModuleInput) or a sharding bug in the code that made it")


def _gather_padded(meta: dict, shards: list, local: list[int], full: list[int], n: int, kept):
    """The shards concatenated and the padding cut: the padding's rows are no part of the model
    (TP=1 has none), so they are not compared; a wrong range still shows in the rows kept."""
    rb = replicated_dim(local, full, n)
    if rb is not None:
        whole, copies, consistent = replicated_gather(shards, *rb)
        # agreeing copies: a shard layout (nothing left to check); disagreeing ones are a replica
        # whose ranks differ, its copies whole tensors as a replica's are
        return Assembled(whole, kept if consistent else copies, f"shard:{rb[0]}",
                         None if consistent else False)
    d = padded_dim(local, full, n)
    if d is None:
        short = _short_of_whole(local, full, n)
        raise (ShortOfWhole if short else NotComparable)(
            f"{meta['key']}: shards of shape {local} at TP={n} cannot be gathered into {full}" + short)
    return Assembled(torch.cat(shards, dim=d).narrow(d, 0, full[d]), kept, f"shard:{d}", None)


def vocab_padded_dim(ref_meta: dict, full: list[int], meta: dict, ref_pad: dict | None,
                     pad: dict | None) -> int | None:
    """The dim of a record of a padded vocab whose padded size differs with TP (vocab_padded), from
    the shapes alone: the one dim of the reference's padded width that is this rank's padded width,
    where the plain rules cannot gather it (padded_dim, shard_dim); else None."""
    n = meta.get("world", 1)
    if not pad or n <= 1 or ref_meta.get("world", 1) != 1 or meta.get("placement"):
        return None
    vocab, width = int(pad["vocab"]), int(pad["local"])
    local = local_shape(meta)
    ref_width = int((ref_pad or {}).get("local", vocab))
    if len(full) != len(local) or width * n < vocab or ref_width < vocab:
        return None
    # the producing modules where they were found: an empty list (logits no probed module's output)
    # knows nothing - read as "no record holds the vocab" it would make the head's own padded output
    # a replica whose ranks differ (a false BUG): the shape rule then, as for a run without the field
    mods = pad.get("modules") or None
    if local == list(full) and mods and not _vocab_record(meta, mods):
        # every real id on rank 0 (vocab <= its padded width): the shard has the reference's whole
        # shape, so any record with a dim of that width would match - a hidden state of 128 in a
        # model padded to 128 read as a vocab shard hid its ranks' differences, and the head's
        # [128, 128] weight, ambiguous, read as a replica whose ranks differ (a false BUG)
        return None
    dims = [d for d in range(len(full)) if full[d] == ref_width and local[d] == width
            and all(full[i] == local[i] for i in range(len(full)) if i != d)]
    if len(dims) > 1 and mods and _vocab_record(meta, mods):
        # a square [padded, padded] weight of the head: its rows are the vocab (nn.Linear's
        # out_features, the logits' last dim)
        dims = [0] if meta.get("kind", "").startswith("param") else [len(full) - 1]
    if len(dims) != 1 or width * n == full[dims[0]] or padded_dim(local, full, n) is not None:
        return None
    return dims[0]


# the records of the modules that produced the padded logits that hold the padded vocab: their
# outputs (the logits' last dim), the grads of those, their own parameters (the head's rows)
_VOCAB_KINDS = ("out", "grad_out", "param_init", "param_grad", "param")


def _vocab_record(meta: dict, modules) -> bool:
    return meta.get("module") in modules and meta.get("kind") in _VOCAB_KINDS


def vocab_padded(ref_meta: dict, ref_stored: torch.Tensor, meta: dict, stored: torch.Tensor,
                 ref_pad: dict | None, pad: dict | None) -> tuple[Assembled, Assembled] | None:
    """(reference, this side) of a record of a padded vocab whose padded size differs with TP -
    Megatron's default, the vocab padded to a multiple of 128 * TP: 100 ids are 128 rows at TP=1,
    256 at TP=2 (128 a rank, rank 1's all padding) - gathered and both cut to the real vocab (the
    padding's rows are no part of the model; a wrong handling of them shows in the rows kept and
    the loss). pad / ref_pad: the worlds' `vocab_padding` (runner/piece.py: their logits were a
    padded vocab, {"vocab", "local" width}). Only where vocab_padded_dim finds the dim and the
    ranks' copies differ (equal copies are a replica); else None."""
    if meta.get("stored") == "single" or list(stored.shape[1:]) != local_shape(meta):
        return None
    d = vocab_padded_dim(ref_meta, list(ref_stored.shape), meta, ref_pad, pad)
    if d is None:
        return None
    shards = list(stored.unbind(0))
    if all(torch.equal(s, shards[0]) for s in shards[1:]):
        return None
    vocab = int(pad["vocab"])
    whole = torch.cat(shards, dim=d).narrow(d, 0, vocab)
    return (Assembled(ref_stored.narrow(d, 0, vocab), None, "replicate", None),
            Assembled(whole, shards, f"shard:{d}", None))


def _batch_of_its_own(meta: dict, local: list[int], full: list[int], n: int) -> ShortOfWhole:
    """A batch record is no shard: every rank of a TP group computes on the whole batch, so a rank
    whose batch is shaped otherwise than the reference's ran on its own part of it - rows that, cut
    along the batch, gathered into the reference's (a data-parallel sampler over the TP ranks) and
    read as a shard, blaming the first module that ran on it."""
    dims = [d for d in range(min(len(local), len(full))) if local[d] != full[d]]
    return ShortOfWhole(
        f"{meta['key']}: each rank's batch has shape {local}, the reference's {full}"
        + (f" (dim {', '.join(map(str, dims))})" if len(local) == len(full) else "")
        + f": every rank of a TP group must get the whole batch, and at TP={n} the ranks held batches of their own - "
        "the inputs were split over the ranks as for data parallelism (a sampler or loader given the "
        "global rank and world size, where TP ranks share one data-parallel rank)")


def assemble(meta: dict, stored: torch.Tensor, full_hint: list[int] | None) -> Assembled:
    n = meta.get("world", 1)
    p = meta.get("placement")
    local = local_shape(meta)
    if n == 1:
        return Assembled(stored, None, "replicate", None)
    if (meta.get("kind") == "batch" and not p and not meta.get("positions") and full_hint is not None
            and list(full_hint) != local):
        raise _batch_of_its_own(meta, local, list(full_hint), n)
    if meta["stored"] == "single":
        shards = None
        if p and p.startswith("shard:"):
            d = int(p.split(":")[1])
            return Assembled(torch.cat([stored] * n, dim=d), None, p, None)
        if p and p.startswith("strided:"):
            return Assembled(unstride([stored] * n, *_strided(p)), None, p, None)
        if p and p.startswith("partial"):
            return Assembled(_reduce_partial(p, [stored] * n, stored.dtype), None, p, None)
        if full_hint is None or list(full_hint) == local:
            return Assembled(stored, None, p or "replicate", True)
        d = shard_dim(local, list(full_hint), n)
        if d is None:
            return _gather_padded(meta, [stored] * n, local, list(full_hint), n, shards)
        return Assembled(torch.cat([stored] * n, dim=d), shards, f"shard:{d}", None)
    shards = list(stored.unbind(0))
    if p and p.startswith("shard:"):
        return Assembled(torch.cat(shards, dim=int(p.split(":")[1])), shards, p, None)
    if p and p.startswith("strided:"):
        return Assembled(unstride(shards, *_strided(p)), shards, p, None)
    if p and p.startswith("partial"):
        return Assembled(_reduce_partial(p, shards, stored.dtype), shards, p, None)
    if p == "replicate":
        return Assembled(shards[0], shards, "replicate", False)
    if full_hint is not None:
        if list(full_hint) == local:
            # Same shape at every rank yet different bits: a replica that is not replicated.
            return Assembled(shards[0], shards, "replicate", False)
        d = shard_dim(local, list(full_hint), n)
        if d is not None:
            return Assembled(torch.cat(shards, dim=d), shards, f"shard:{d}", None)
        return _gather_padded(meta, shards, local, list(full_hint), n, shards)
    return Assembled(None, shards, "stacked", None)


def narrow_positions(t, dim: int, rows: int, n: int):
    """The first n positions of a record whose dim `dim` holds the sequence (rows > 1: `rows`
    sequences' positions flat, [rows * L] - a linear's mm at batch > 1): what a decode run of
    the first n positions records there (runner/prefix.py)."""
    if rows == 1:
        return t.narrow(dim, 0, n)
    return t.unflatten(dim, (rows, -1)).narrow(dim + 1, 0, n).flatten(dim, dim + 1)


def first_positions(a: torch.Tensor, b: torch.Tensor, where) -> torch.Tensor:
    """The reference's whole record cut to the positions a decode run of the first n made
    (runner/prefix.py; meta positions = [dim, rows, n, L]), where it is still whole."""
    if not where or a.shape == b.shape:
        return a
    d, rows, n, L = where
    if a.dim() > d and a.shape[d] == rows * L:
        return narrow_positions(a, d, rows, n)
    return a
