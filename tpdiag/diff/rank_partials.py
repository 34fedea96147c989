"""The size of the per-rank partial sums a row-parallel Linear's all-reduce adds (diff/oracle.py).

y = x W^T with W's input dim split over T ranks is, at TP=T, sum_r p_r with p_r = x_r W_r^T
computed by each rank and ROUNDED to the output dtype before the sum. Each rounding is up to
u |p_r| - a rounding TP=1 never makes: its GEMM accumulates the whole dot product and rounds once,
u |y|. Where the partials cancel (|p_r| >> |y|) the reordering's error is the partials' roundings,
far more than the reference's own error, and a float64 oracle scaled by the reference's error
alone calls a correct RowwiseParallel a bug (bf16, partials 30x the output: 2.2x "beyond
rounding"; tests/test_partials_cancel.py). The one-rounding level of the partials,
u sqrt(sum_r ||p_r||^2), is what such a sum may lose (bounds.linear_bound's (T+1) u_out |x||W|
term, in the oracle's 2-norm)."""
from __future__ import annotations

import math

import torch

from tpdiag.records.keys import record_key


def partials_norm(x: torch.Tensor, w: torch.Tensor, world: int) -> float | None:
    """sqrt(sum_r ||x_r W_r^T||^2) over the T = world chunks of the input dim (DTensor's Shard
    chunks: torch.chunk), in float64; None when it cannot be formed."""
    if world < 2 or x.shape[-1] != w.shape[-1] or not (x.is_floating_point() and w.is_floating_point()):
        return None
    k = x.shape[-1]
    x64, w64 = x.to(torch.float64), w.to(torch.float64)
    total = 0.0
    for cols in torch.arange(k).chunk(world):
        if cols.numel():
            total += float(torch.linalg.vector_norm(x64[..., cols] @ w64[:, cols].T)) ** 2
    return math.sqrt(total) if math.isfinite(total) else None


def reduces_over_ranks(weight_row: dict | None) -> bool:
    """A Linear weight split along its input dim at this degree (a RowwiseParallel plan, or a
    weight recorded so): its output is a sum of rank partials."""
    return bool(weight_row) and weight_row.get("layout") == "shard:1"


def partials_in(dd, row: dict) -> float:
    """sqrt(sum ||p_r||^2) of the rank partials this side rounded and summed in this forward call
    (the module doc): the record's own, or its sub-modules' in the same call - a block whose
    output is its row-parallel projection's plus a residual carries the same roundings. For an
    input grad (a grad_out record) those of its column-parallel consumers (dgrad_partials)."""
    if row["phase"] == "backward" and row["kind"] == "grad_out":
        return dgrad_partials(dd, row)
    if row["phase"] != "forward" or row["kind"] != "out":
        return 0.0
    if row.get("rank_partials_norm"):
        return row["rank_partials_norm"]
    starts, normed = _index(dd)
    if not normed:
        return 0.0
    start = starts.get((row["step"], row["module"], row.get("call")))
    if start is None:
        return 0.0
    from tpdiag.records.keys import ROOTS

    # the root's: every module's ("(root)" above HF's `model` child, which is read as the root too:
    # a superset, as before RECORD_FORMAT 3)
    pre = row["module"] + "." if row["module"] not in ROOTS else ""
    got = [p for idx, step, module, p in normed
           if step == row["step"] and start < idx < row["idx"] and module.startswith(pre)]
    return math.sqrt(sum(p * p for p in got))


def _index(dd) -> tuple[dict, list]:
    """({(step, module, call): idx of its first forward input}, [(idx, step, module, norm)] of the
    rows with a partials norm), built once per diff: asked for every judged record, a scan of the
    rows each time was quadratic in them."""
    ix = getattr(dd, "_partials_ix", None)
    if ix is None or ix[0] != len(dd.rows):
        starts: dict = {}
        normed = []
        for r in dd.rows:
            if r["kind"] == "in" and r["phase"] == "forward":
                starts.setdefault((r["step"], r["module"], r.get("call")), r["idx"])
            if r.get("rank_partials_norm"):
                normed.append((r["idx"], r["step"], r["module"], r["rank_partials_norm"]))
        ix = dd._partials_ix = (len(dd.rows), starts, normed)
    return ix[1], ix[2]


def dgrad_partials(dd, row: dict) -> float:
    """The backward mirror, for the grad_out record of X: a consumer of X whose weight W [out, in]
    is recorded cut on its output dim (a column-parallel Linear - a plan's ColwiseParallel or
    hand-written; the ranks' shards) computes X's grad as sum_r g_r W_r, each rank's share, over
    its own output columns, rounded before the all-reduce. Where those cancel (W's rows [K a;
    -K a + b] whose two halves a block adds) they dwarf the reference's error: a correct bf16
    hand-written column layer read `sharding-bug`, 2.3x (planted cancel_handwritten.py:cancel_col).
    sqrt(sum over such consumers and ranks of ||g_r W_r||^2), this side's g and W; 0 where none."""
    cons = row.get("consumers") or ()
    if not cons or row["key"] not in dd.tensors:
        return 0.0
    width = dd.tensors[row["key"]][1].shape[-1] if dd.tensors[row["key"]][1].dim() else None
    world = int(getattr(dd, "world", 0) or 0)
    total = 0.0
    for m in cons:
        w = _cut_weight(dd, row["step"], m)
        g = dd.tensors.get(record_key(row["step"], "backward", m, "grad_out", 0, "0"))
        if w is None or g is None or world < 2:
            continue
        wn, gn = w[1], g[1]
        if wn.dim() != 2 or gn.shape[-1] != wn.shape[0] or wn.shape[1] != width \
                or not (gn.is_floating_point() and wn.is_floating_point()):
            continue
        g64, w64 = gn.to(torch.float64), wn.to(torch.float64)
        for rows in torch.arange(wn.shape[0]).chunk(world):
            if rows.numel():
                total += float(torch.linalg.vector_norm(g64[..., rows] @ w64[rows])) ** 2
    return math.sqrt(total) if math.isfinite(total) else 0.0


def _cut_weight(dd, step: int, module: str):
    """(reference, this side) of the module's `weight` as its forward at `step` read it, where that
    is recorded cut on its output dim (layout shard:0); None otherwise."""
    from tpdiag.records.keys import record_key

    key = (record_key(0, "init", module, "param_init", 0, "weight") if step == 0
           else record_key(step - 1, "optimizer", module, "param", 0, "weight"))
    if key not in dd.tensors:
        return None
    rows = getattr(dd, "_weight_rows", None)
    if rows is None or rows[0] != len(dd.rows):
        rows = (len(dd.rows), {r["key"]: r for r in dd.rows if r["kind"] in ("param_init", "param")})
        try:
            dd._weight_rows = rows
        except AttributeError:
            pass
    r = rows[1].get(key)
    from tpdiag.diff.anchored import read_pair

    return read_pair(dd, key, step) if r is not None and r.get("layout") == "shard:0" else None

