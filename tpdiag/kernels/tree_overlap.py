"""The tree all-reduce of a fixed linear in row chunks: each chunk's collective runs under the
next chunk's GEMM.

Why: rounding once after the whole sum puts the fp32 partials on the wire - 1.5x the bytes of a
stock bf16 all-reduce at two ranks - and the collective waits for the whole GEMM (a TP=2
llama-1b step: the fp32 reduce-scatter + bf16 all-gather 100 ms against stock's 76 ms,
docs/benchmarks.md). Row chunks change no bit: the GEMMs' bits per row do not depend on the rows
per call (invariant-gemm, tree_mm), and the tree's top is elementwise, whichever rank owns an
element. So chunk c's reduce-scatter (or all-to-all) is issued asynchronously as soon as its
partial exists and the GEMM of chunk c + 1 runs beside it; the persistent GEMM leaves SMs free
for the collective's kernels (invariant_gemm.sms_left_free). The rounded chunks are then
all-gathered into the output.

Off unless TPDIAG_TREE_OVERLAP=1, because it did not pay: `python -m benchmarks fix-cost --tp 2,4
--groups tp --overlap` on 4x H100 (commit 7d01ded) read TP=2 1.13x -> 1.14x and TP=4 1.23x ->
1.29x of stock; a profiled step put 36 ms of the collectives under compute but their own time
grew 103 -> 131 ms (4x the kernels, sharing SMs) and the GEMMs' by 20 ms (docs/benchmarks.md).
Taken only where the collectives are torch's own (no probe wraps them: a compare's records keep
one collective per call) and the rows are many.
"""
from __future__ import annotations

import os

import torch

from tpdiag.kernels import alloc
from tpdiag.kernels.tree import _collective, _group, direct, tree_sum_stacked_to, world_size

ON = [os.environ.get("TPDIAG_TREE_OVERLAP", "0") == "1"]


def knob(name: str, default: int) -> int:
    """A whole number from the environment (unset or empty: default). Anything else is BadInput, one
    line (compare reads these before any world: runner/checks.py) - `int()` at import failed every
    world of a --fix run with a ValueError."""
    from tpdiag.base.env import whole

    return whole(name, default)


CHUNKS = [knob("TPDIAG_TREE_OVERLAP_CHUNKS", 4)]
FREE_SMS = [knob("TPDIAG_TREE_OVERLAP_SMS", 16)]
MIN_ROWS = 1024  # per chunk: below this the launches, not the bytes, are the cost

_RS = ("reduce_scatter_single", "reduce_scatter_tensor")
_A2A = ("all_to_all_single", "all_to_all_single")
_AG = ("all_gather_single", "all_gather_into_tensor")


def usable(rows: int) -> bool:
    # asked on every fixed linear's forward and dgrad: the switch first, the rest only when on
    if not ON[0] or CHUNKS[0] < 2 or rows < CHUNKS[0] * MIN_ROWS:
        return False
    w = world_size()
    return w > 1 and direct(*(_RS if w == 2 else _A2A)) and direct(*_AG)


def _bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-rows // chunks)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def reduce_in_chunks(partial, rows: int, n: int, out_dtype: torch.dtype, device) -> torch.Tensor:
    """[rows, n] in out_dtype: the tree's top over ranks of partial(r0, r1) (this rank's fp32
    subtree roots of rows r0:r1), rounded once - tree_reduce_scattered's bits, chunk by chunk."""
    from tpdiag.kernels.invariant_gemm import sms_left_free

    w, group = world_size(), _group()
    out = alloc.empty(rows * n, dtype=out_dtype, device=device)
    issued = []
    with sms_left_free(FREE_SMS[0] if device.type == "cuda" else 0):
        for r0, r1 in _bounds(rows, CHUNKS[0]):
            flat = partial(r0, r1).contiguous().reshape(-1)
            m = flat.numel()
            chunk = -(-m // w)
            if chunk * w != m:
                flat = torch.nn.functional.pad(flat, (0, chunk * w - m))
            if w == 2:  # one add, which commutes: the collective's own sum is the tree's top
                buf = alloc.empty(chunk, dtype=flat.dtype, device=device)
                work = _collective(*_RS, buf, flat, group, wait=False)
            else:
                buf = alloc.empty_like(flat)
                work = _collective(*_A2A, buf, flat, group, wait=False)
            issued.append((work, flat, buf, r0, r1, chunk))
    gathers = []
    for work, flat, buf, r0, r1, chunk in issued:
        if work is not None:
            work.wait()
        mine = buf.to(out_dtype) if w == 2 else tree_sum_stacked_to(buf.view(w, chunk), out_dtype)
        dst = out[r0 * n:r1 * n]
        padded = chunk * w != dst.numel()
        target = alloc.empty(chunk * w, dtype=out_dtype, device=device) if padded else dst
        gathers.append((_collective(*_AG, target, mine, group, wait=False), mine, target, dst, padded))
    for work, _mine, target, dst, padded in gathers:
        if work is not None:
            work.wait()
        if padded:
            dst.copy_(target[:dst.numel()])
    return out.view(rows, n)
