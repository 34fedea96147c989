"""An op record whose rows are a sharded activation's leading dims flattened.

A Linear called on a sequence shard [B, S/N, D] runs `aten::mm` on [B*S/N, D]: its rows are the
rank's positions of every batch row, batch-major. Gathered by shape alone (the one dim that shrank
by N, dim 0) the ranks' row blocks are stacked - [b0 p0-3, b1 p0-3, b0 p4-7, b1 p4-7] where the
reference holds [b0 p0-7, b1 p0-7] - and a correct GEMM read as a wrong result, 1.3e6x beyond
rounding (planted context_parallel.py:cp_is_causal's `attn.wq :: aten::mm`, a false sharding-bug
after the real one; red team hred15). Where the op's module records, at the same step, phase and
call, an activation whose dims d..k the op's dim d flattens - k the activation's sharded dim, the
same dims before d - the op's shards are put back as that activation's are: each viewed as those
dims, joined on dim k, flattened again.
The records do not say which way the user's code flattened: sequence-first code (Megatron's
[S, B, D]) flattens a batch-first activation position-major - `x.transpose(0, 1).reshape(-1, D)`,
rows p0 b0, p0 b1, ... - and there the ranks' blocks stacked ARE TP=1's rows; put back batch-major
they read a correct GEMM 1.3e6x beyond rounding, a false sharding-bug (planted seq_major.py, red
team hreview15). Of the two structural candidates the nearer to the reference is read (nearer).
That hides no wrong result: a row-wise op whose rows equal the reference's in one of the two
orders computed the reference's rows; a wrong order of them shows where the module puts its rows
back (its own out record, whose layout the diff knows)."""
from __future__ import annotations

import math

import torch

from tpdiag.records.keys import RecordKey
from tpdiag.records.layout import Assembled, local_shape, shard_dim

_KINDS = ("in", "out", "grad_out")


def _module_dims(meta: dict, other, ref) -> list[tuple[list[int], list[int], int]]:
    """[(local shape, full shape, shard dim)] of the op's module's activations at this call."""
    out = []
    for kind in _KINDS:
        key = RecordKey(meta["step"], meta["phase"], meta["module"], kind, meta.get("call", 0), "0").format()
        om, rm = other.by_key.get(key), ref.by_key.get(key)
        if om is None or rm is None or om.get("stored") == "hash":
            continue
        n, local = om.get("world", 1), local_shape(om)
        full = local_shape(rm) if rm.get("world", 1) == 1 else None
        p = om.get("placement")
        if p and p.startswith("shard:"):
            k = int(p.split(":")[1])
            full = list(local)
            full[k] *= n
        if full is None:
            continue
        k = shard_dim(local, full, n)
        if k is not None:
            out.append((local, full, k))
    return out


def rows_of(om: dict, rm: dict, other, ref) -> tuple[list[int], list[int], int] | None:
    """(the op's local shape unflattened, its full shape, the dim to join on), or None where the
    op's shards are not a flattened sharded activation (the plain shape rule stands)."""
    if om.get("kind") != "op" or om.get("placement") or om.get("stored") != "stacked":
        return None
    if rm.get("world", 1) != 1:
        return None  # a reference that is itself sharded: its own op would need the same (not handled)
    n, local, full = om.get("world", 1), local_shape(om), local_shape(rm)
    d = shard_dim(local, full, n)
    if d is None:
        return None
    for act_local, act_full, k in _module_dims(om, other, ref):
        if k <= d or act_local[:d] != local[:d] or math.prod(act_local[:k]) == math.prod(act_local[:d]):
            continue  # not a flattening, or the dims before the shard are all 1 (the plain rule is right)
        if math.prod(act_local[d:k + 1]) == local[d] and math.prod(act_full[d:k + 1]) == full[d]:
            return local[:d] + act_local[d:k + 1] + local[d + 1:], full, k
    return None


def assemble_rows(stored: torch.Tensor, shape: tuple[list[int], list[int], int]) -> Assembled:
    unflat, full, k = shape
    shards = list(stored.unbind(0))
    whole = torch.cat([s.reshape(unflat) for s in shards], dim=k).reshape(full)
    return Assembled(whole, shards, f"shard:{k}", None)


def nearer(plain, put_back: tuple[Assembled, Assembled]) -> tuple[Assembled, Assembled]:
    """(reference, this side) of the two candidates - `plain()`, the shape rule's pair, and
    `put_back`, the module activation's - whose wholes are the nearer (largest |difference|, NaN
    the farthest); put_back where they tie or the shape rule has no pair."""
    from tpdiag.errors import NotComparable

    try:
        pa, pb = plain()
    except (NotComparable, RuntimeError, ValueError):  # no shape-rule pair: the put-back as before
        return put_back
    fa, fb = put_back
    if pa.full is None or pb.full is None or pa.full.shape != pb.full.shape:
        return put_back
    return (pa, pb) if _distance(pa.full, pb.full) < _distance(fa.full, fb.full) else put_back


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float(d.nan_to_num(nan=math.inf).max()) if d.numel() else 0.0
