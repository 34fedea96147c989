"""Many records hashed in one launch of _hash_batch_kernel (kernels/hash_buffer.py queues them):
each record's launch key and table row, the launch, and its arguments. The lanes are
record_hash.py's, bit for bit; the launch machinery (the compiled kernels, the direct launch, the
register cap, the launch shape) is record_hash's, read through the module at each call so that a
benchmark's or a test's stand-in for one of them (record_hash._direct, narrow_regs, _triton) is
the one both launch paths use."""
from __future__ import annotations

import torch

from tpdiag.kernels import record_hash as rh

TABLE_COLS = 8  # data pointer, ROW, A, SLAB, F_B, O_B, N_COL, TOTAL


_ENTRY: dict = {}  # (shape, dtype, dim, full, offset) -> (key without alignment, table row tail)


def batch_entry(t: torch.Tensor, dim, full, offset, row: int):
    """(launch key, raw words, table row) of one record for _hash_batch_kernel. The words
    must stay alive, unmodified, until the launch (the caller checks their _version)."""
    shape_key = (t.shape, t.dtype, dim, full, offset)
    hit = _ENTRY.get(shape_key)
    if hit is None:  # a step has few distinct shapes: plan each once (host time per record)
        a, L, b, F, o = rh.slab(t.shape, dim, full, offset)
        width, _ = rh._TRITON_T[t.dtype]
        slab_n = L * b
        # the chunk length the plan is made for travels in the key, so that the kernel launched
        # for this row hashes chunks of that length (a tile count changed later - the
        # benchmarks' hash-itersN - cannot pair a plan with another chunk length)
        iters = rh.iters_for(width)
        _, _, row_iters, n_row, n_col, _ = rh.plan(a, slab_n, rh.BLOCK, iters)
        hit = _ENTRY[shape_key] = ((width, t.dtype == torch.bfloat16, rh.BLOCK, row_iters, slab_n % 16 == 0, iters),
                                   [a, slab_n, F * b, o * b, n_col, n_row * n_col])
    words = t.contiguous().view(rh._TRITON_T[t.dtype][1])
    ptr = words.data_ptr()
    return hit[0] + (ptr % 16 == 0,), words, [ptr, row, *hit[1]]


def batch_launch(key, table: torch.Tensor, n: int, nprog: int, ints: torch.Tensor,
                 floats: torch.Tensor, *, warps: int = rh.WARPS) -> None:
    """One launch for n records that share `key` (batch_entry): `table` holds their rows
    (int64 [n, TABLE_COLS], on the device), the hashes go to rows of (ints, floats)."""
    args = batch_args(key, table, nprog, ints, floats)
    dev = ints.device
    width, is_bf16, _, row_iters, slab16, _, aligned = key
    # the batch kernel reads words where PAIRS and the record allows it (_hash_batch_kernel)
    regs = rh.narrow_regs(row_iters, width, bool(args[11] and is_bf16 and aligned and slab16))
    ck = ("batch", dev.index, key, args[11:], warps, table.data_ptr() % 16 == 0, ints.data_ptr() % 16 == 0,
          floats.data_ptr() % 16 == 0, regs)
    rh._direct(ck, (nprog, n, 1), args, dev, lambda: rh._triton()._hash_batch_kernel[(nprog, n)](
        *args[:4], **dict(zip(BATCH_CONSTEXPRS, args[4:])), num_warps=warps, **rh._cap(regs, dev)))


# _hash_batch_kernel's constexprs in its parameter order. A compiled kernel launched directly
# (_direct) takes every parameter, constexprs included, positionally: one missing is a
# TypeError on the GPU only (session 8's MIX was, until tests/test_hash_batch.py checked this).
BATCH_CONSTEXPRS = ("WIDTH", "IS_BF16", "BLK", "ITERS", "ROW_ITERS", "ALIGNED", "SLAB16", "PAIRS", "MIX")


def batch_args(key, table, nprog: int, ints, floats) -> tuple:
    """_hash_batch_kernel's arguments, all of them, in its parameter order."""
    width, is_bf16, blk, row_iters, slab16, iters, aligned = key
    return (table, ints, floats, nprog, width, is_bf16, blk, iters, row_iters, aligned, slab16,
            rh.PAIRS[0] and rh.pairs_ok(ints.device), rh.HASH_VERSION)


def batch_nprog(total_max: int, device, width: int = 32, records: int = 1) -> int:
    return min(total_max, rh.waves_for(width, records) * rh._sm_count(device))
