"""The Triton kernels of the record hash (CUDA; the Triton interpreter runs them on the CPU).

The definition of the lanes and statistics, the shard layout and the launch shapes are in
record_hash.py (its docstring); record_hash_ref.py holds the torch path, bit for bit the same
lanes. These kernels walk a record's chunks and tiles; what one tile adds to the lanes and the
statistics is record_hash_tile.py's. Only SLAB is specialised (its divisibility by 16 lets loads vectorise): the other integers
change from record to record, and each new specialisation is a compile (~0.5 s) plus per-launch
key work. Imports Triton at import time: import this module lazily (record_hash._triton()).
"""
from __future__ import annotations

import triton
import triton.language as tl

# the tile's arithmetic, and whether the word-pairs path's inline PTX runs (record_hash_tile.py)
from tpdiag.kernels.record_hash_tile import _PTX, _accum, _accum_pairs, _as_f32


@triton.jit(do_not_specialize=["ROW", "A", "F_B", "O_B", "N_COL", "TOTAL", "NPROG"])
def _hash_kernel(w_ptr, ints_ptr, floats_ptr, ROW, A, SLAB, F_B, O_B, N_COL, TOTAL, NPROG,
                 WIDTH: tl.constexpr, IS_BF16: tl.constexpr, BLK: tl.constexpr, ITERS: tl.constexpr,
                 ROW_ITERS: tl.constexpr, PAIRS: tl.constexpr = False, MIX: tl.constexpr = 2):
    """One record: its chunks over NPROG persistent programs (see _hash_chunks)."""
    _hash_chunks(w_ptr, ints_ptr, floats_ptr, ROW, A, SLAB, F_B, O_B, N_COL, TOTAL, NPROG,
                 tl.program_id(0), WIDTH, IS_BF16, BLK, ITERS, ROW_ITERS, PAIRS, MIX)


@triton.jit(do_not_specialize=["NPROG"])
def _hash_batch_kernel(table_ptr, ints_ptr, floats_ptr, NPROG,
                       WIDTH: tl.constexpr, IS_BF16: tl.constexpr, BLK: tl.constexpr, ITERS: tl.constexpr,
                       ROW_ITERS: tl.constexpr, ALIGNED: tl.constexpr, SLAB16: tl.constexpr,
                       PAIRS: tl.constexpr = True, MIX: tl.constexpr = 2):
    """Many records in one launch (grid: NPROG x records), each described by a row of `table`
    (int64: data pointer, ROW, A, SLAB, F_B, O_B, N_COL, TOTAL). The records of one launch share
    the constexprs; ALIGNED / SLAB16 restore what the one-record kernel gets from Triton's
    specialisation (16-byte aligned data, SLAB % 16 == 0: vector loads). PAIRS: bf16 records
    that are ALIGNED with SLAB16 are read as 32-bit words (_hash_chunks); False: never."""
    rec = table_ptr + tl.program_id(1).to(tl.int64) * 8
    pid = tl.program_id(0)
    TOTAL = tl.load(rec + 7)
    if pid < TOTAL:  # a small record uses fewer programs than the launch has
        if WIDTH == 16:
            w_ptr = tl.load(rec).to(tl.pointer_type(tl.int16))
        else:
            w_ptr = tl.load(rec).to(tl.pointer_type(tl.int32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
        SLAB = tl.load(rec + 3)
        if SLAB16:
            SLAB = tl.multiple_of(SLAB, 16)
        _hash_chunks(w_ptr, ints_ptr, floats_ptr, tl.load(rec + 1), tl.load(rec + 2), SLAB,
                     tl.load(rec + 4), tl.load(rec + 5), tl.load(rec + 6), TOTAL, NPROG, pid,
                     WIDTH, IS_BF16, BLK, ITERS, ROW_ITERS, PAIRS and IS_BF16 and ALIGNED and SLAB16, MIX)


@triton.jit
def _hash_chunks(w_ptr, ints_ptr, floats_ptr, ROW, A, SLAB, F_B, O_B, N_COL, TOTAL, NPROG, pid,
                 WIDTH: tl.constexpr, IS_BF16: tl.constexpr, BLK: tl.constexpr, ITERS: tl.constexpr,
                 ROW_ITERS: tl.constexpr, PAIRS: tl.constexpr, MIX: tl.constexpr):
    """A program hashes chunks - ITERS tiles of BLK elements: along a slab (ROW_ITERS 0), one a
    slab stacked over the slabs (1), or for slabs of a power of two up to BLK (2, dense) BLK /
    SLAB whole slabs a tile, contiguous - and adds its shares to row ROW of the record buffer
    with atomics: integer adds (the lanes, the non-finite count) and an integer max (max |x| as
    the bits of a non-negative float64, which order like the values) are exact in any order; the
    two float sums are statistics, not evidence, and may vary in their last bits. Persistent:
    NPROG programs stride over the TOTAL chunks, so a record costs a few hundred atomics on its
    row, not one per chunk (contention on one address serialises them).

    One compiled variant serves every record of a layout (record_hash.plan): the tile is one
    register row of BLK elements whatever the slab width (a dense tile's lanes know their slab
    and column from SLAB, worked out once a program), and whether a chunk is full is a runtime
    branch - full chunks (the common case) run the unrolled, unmasked loop, the last chunks of a
    ragged record a masked loop over its tiles that are in. Each specialised integer was a
    variant that a fresh machine compiled (~1-2.5 s each on an H200 host) inside the first
    worlds (docs/scale.md).

    Statistics, fast path: plain sums and max |x| of every element, no finiteness test per
    element (at 2 bytes an element the integer/compare pipe, not memory, was the limit: the
    test, select and count were 5 of ~19 instructions an element). Exact because a NaN or an
    infinity poisons the fp32 sum of its register lane (NaN + y = NaN, inf + finite = inf,
    inf - inf = NaN): if every lane's sum and sum of squares is finite at the end, no element
    was non-finite, the count is 0 and the max is that of finite values. Otherwise - a
    non-finite element, or finite ones whose fp32 sum or square overflows - the program
    re-reads its chunks for the statistics alone, testing each element (_stats_exact). The
    lanes never depend on which path ran."""
    # PAIRS (bf16, SLAB even, 4-byte aligned): a tile is BLK / 2 32-bit words of two elements
    # each - half the loads, the high half's fp32 bits a multiply-add, one max for both halves
    # (_accum_pairs; fp16 gains nothing: its conversion is not a bit move; `probes sass`)
    EW: tl.constexpr = 2 if PAIRS else 1         # elements a word
    TT: tl.constexpr = BLK // EW                 # words a tile, held as ONE register row
    # DENSE (ROW_ITERS 2): the R slabs of a tile are contiguous, one row of R * TW words whose
    # lanes' row offsets (lane // TW) * F_B * C2 are folded into the per-lane position constant
    # once a program. bf16 word pairs 512 wide, sm_90 (`probes sass` with Triton 3.9 on the CPU):
    # 95 registers as [R, TW], 66 as one row. An H200 read fp32 512-wide shards at 4275-4284 GB/s
    # this way (uncapped), against 3867-3903 for [R, TW] tiles capped (`git show d055ef2:docs/benchmarks.md`,
    # "Session 18")
    DENSE: tl.constexpr = ROW_ITERS == 2
    cc = tl.arange(0, TT)
    if DENSE:
        r = BLK // SLAB                          # slabs a tile
    else:
        r = 1
    lane_row, ccw = _lanes(cc, SLAB, EW, DENSE)  # each word's slab in the tile, word in the slab
    # k * C2 = (slab start + j0) * C2 + cc * C2 (mod 2**32): one add per element (per word with
    # PAIRS: the high element's + C2 rides in its multiply, see _accum_pairs) for the position
    if PAIRS:
        cc_c2 = ccw.to(tl.uint32) * tl.full([TT], 0x0BD794EE, tl.uint32)  # 2 * C2
    else:
        cc_c2 = ccw.to(tl.uint32) * tl.full([TT], 0x85EBCA77, tl.uint32)
    if DENSE:
        fb_c2 = (((F_B.to(tl.int64) & 0xFFFFFFFF) * 0x85EBCA77) & 0xFFFFFFFF).to(tl.uint32)
        cc_c2 += lane_row.to(tl.uint32) * fb_c2
    cc_c2 = cc_c2[None, :]
    c1 = tl.full([1, TT], 0x9E3779B1, tl.uint32)
    c3 = tl.full([1, TT], 0x85EBCA6B, tl.uint32)
    acc_a = tl.zeros([1, TT], dtype=tl.uint32)
    acc_b = tl.zeros([1, TT], dtype=tl.uint32)
    acc_s = tl.zeros([1, TT], dtype=tl.float32)
    acc_q = tl.zeros([1, TT], dtype=tl.float32)
    if PAIRS and _PTX:
        acc_m = tl.zeros([1, TT], dtype=tl.uint32)  # max |x| of both halves as bf16x2 (_max_pairs)
    else:
        acc_m = tl.zeros([1, TT], dtype=tl.float32)
    if PAIRS:
        base = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        base = w_ptr
    # tile `it` of a chunk = its first tile moved by `it` steps: BLK columns along the slab, or r
    # slabs (ROW_ITERS); its positions' k * C2 move by the step's k times C2 (mod 2**32, linear)
    # - the int64 index arithmetic is done once a chunk, not once a tile
    if ROW_ITERS:
        k_step = ((((F_B.to(tl.int64) * r) & 0xFFFFFFFF) * 0x85EBCA77) & 0xFFFFFFFF).to(tl.uint32)
    else:
        k_step = tl.full([], (BLK * 0x85EBCA77) & 0xFFFFFFFF, tl.uint32)
    # chunk -> (row group, column group) without a division a chunk: NPROG = dq * N_COL + dr
    dq = NPROG // N_COL
    dr = NPROG % N_COL
    # two walks over the program's chunks: the full ones (the common case) unrolled and unmasked,
    # then a ragged record's last chunks masked. One walk with both in it held registers across
    # the full chunks' loop for the masked one (sm_90, fp32 whole tensors: 96 -> 158, 3 programs
    # an SM instead of 5; `probes sass`)
    rg = (pid // N_COL).to(tl.int64)
    cg = (pid % N_COL).to(tl.int64)
    for _ in range(pid, TOTAL, NPROG):
        row0, col0 = _chunk_origin(rg, cg, r, BLK, ITERS, ROW_ITERS)
        if _chunk_full(row0, col0, A, SLAB, r, BLK, ITERS, ROW_ITERS):
            kc2, wstart = _chunk_start(row0, col0, SLAB, F_B, O_B, PAIRS)
            for it in tl.static_range(ITERS):
                # along a slab or dense: tile `it` is the constant it * TT words further, an
                # immediate the loads take; stacked: it slabs further (SLAB's runtime stride)
                if ROW_ITERS == 1:
                    off = wstart + it * (tl.zeros([], tl.int64) + (SLAB >> 1 if PAIRS else SLAB))
                else:
                    off = wstart + it * TT
                raw = tl.load(base + off + cc[None, :])
                if PAIRS:
                    acc_a, acc_b, acc_s, acc_q, acc_m = _accum_pairs(
                        raw, None, kc2 + it * k_step, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m,
                        1, TT, True, MIX)
                else:
                    acc_a, acc_b, acc_s, acc_q, acc_m = _accum(
                        raw, None, kc2 + it * k_step, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m,
                        WIDTH, IS_BF16, 1, TT, True, MIX)
        rg, cg = _next_chunk(rg, cg, dq, dr, N_COL)
    rg = (pid // N_COL).to(tl.int64)
    cg = (pid % N_COL).to(tl.int64)
    for _ in range(pid, TOTAL, NPROG):
        row0, col0 = _chunk_origin(rg, cg, r, BLK, ITERS, ROW_ITERS)
        if not _chunk_full(row0, col0, A, SLAB, r, BLK, ITERS, ROW_ITERS):
            # the tiles that hold an element, each masked (a masked word is 0: finite, adds to no
            # statistic; its lanes are masked in _accum*)
            kc2, wstart = _chunk_start(row0, col0, SLAB, F_B, O_B, PAIRS)
            m_row, m_col = _lanes(cc, SLAB, EW, DENSE)
            for it in range(_chunk_tiles(row0, col0, A, SLAB, r, BLK, ITERS, ROW_ITERS)):
                mask = _tile_mask(row0, col0, it, m_row, m_col * EW, A, SLAB, r, BLK, ROW_ITERS)
                if ROW_ITERS == 1:
                    off = wstart + it * (tl.zeros([], tl.int64) + (SLAB >> 1 if PAIRS else SLAB))
                else:
                    off = wstart + it * TT
                raw = tl.load(base + off + cc[None, :], mask=mask, other=0)
                kt = kc2 + tl.cast(it, tl.uint32) * k_step
                if PAIRS:
                    acc_a, acc_b, acc_s, acc_q, acc_m = _accum_pairs(
                        raw, mask, kt, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m, 1, TT, False, MIX)
                else:
                    acc_a, acc_b, acc_s, acc_q, acc_m = _accum(
                        raw, mask, kt, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m,
                        WIDTH, IS_BF16, 1, TT, False, MIX)
        rg, cg = _next_chunk(rg, cg, dq, dr, N_COL)
    fmax = 3.4028234663852886e38
    poisoned = tl.sum(tl.sum(((tl.abs(acc_s) <= fmax) & (tl.abs(acc_q) <= fmax)).to(tl.int32) ^ 1,
                             axis=1), axis=0)
    sum_s = tl.sum(tl.sum(acc_s, axis=1), axis=0)
    sum_q = tl.sum(tl.sum(acc_q, axis=1), axis=0)
    if PAIRS and _PTX:
        mw = acc_m & 0x7FFF7FFF  # XORSIGN left the signs as they fell: the magnitudes are the max
        acc_m = tl.maximum((mw << 16).to(tl.float32, bitcast=True),
                           (mw & 0xFFFF0000).to(tl.float32, bitcast=True))
    max_m = tl.max(tl.max(acc_m, axis=1), axis=0)
    count_n = tl.sum(tl.sum(tl.zeros([1, TT], dtype=tl.int32), axis=1), axis=0)
    if poisoned > 0:  # rare: see the docstring
        sum_s, sum_q, max_m, count_n = _stats_exact(w_ptr, A, SLAB, N_COL, TOTAL, NPROG, pid, WIDTH,
                                                    IS_BF16, BLK, ITERS, ROW_ITERS)
    row_i = ints_ptr + ROW * 4
    row_f = floats_ptr + ROW * 2
    # relaxed: nothing reads the row before the launch ends (a kernel boundary orders it), and
    # the default acq_rel put a full fence, a returning atomic and an L1 invalidate in every
    # program's tail, six times
    tl.atomic_add(row_i + 0, tl.sum(tl.sum(acc_a.to(tl.int64), axis=1), axis=0), sem="relaxed")
    tl.atomic_add(row_i + 1, tl.sum(tl.sum(acc_b.to(tl.int64), axis=1), axis=0), sem="relaxed")
    tl.atomic_add(row_i + 2, count_n.to(tl.int64), sem="relaxed")
    tl.atomic_max(row_i + 3, max_m.to(tl.float64).to(tl.int64, bitcast=True), sem="relaxed")
    tl.atomic_add(row_f + 0, sum_s.to(tl.float64), sem="relaxed")
    tl.atomic_add(row_f + 1, sum_q.to(tl.float64), sem="relaxed")


@triton.jit
def _lanes(cc, SLAB, EW: tl.constexpr, DENSE: tl.constexpr):
    """(slab in the tile, word in the slab) of each lane `cc` of a tile: a dense tile holds
    BLK / SLAB whole slabs of SLAB // EW words; any other, one stretch of one slab."""
    if DENSE:
        lane_row = cc // (SLAB // EW)
        return lane_row, cc - lane_row * (SLAB // EW)
    else:
        return cc * 0, cc


@triton.jit
def _next_chunk(rg, cg, dq, dr, N_COL):
    """(row group, column group) of the chunk NPROG = dq * N_COL + dr after (rg, cg)."""
    cg = cg + dr
    wrap = cg >= N_COL
    return rg + dq + wrap.to(tl.int64), tl.where(wrap, cg - N_COL, cg)


@triton.jit
def _chunk_origin(rg, cg, r, BLK: tl.constexpr, ITERS: tl.constexpr, ROW_ITERS: tl.constexpr):
    """(first slab, first column) of the chunk at row group rg, column group cg (int64): along a
    slab a chunk is ITERS * BLK columns of one slab; stacked, ITERS * r slabs of BLK columns."""
    if ROW_ITERS:
        return rg * (r * ITERS), cg * BLK
    else:
        return rg, cg * (BLK * ITERS)


@triton.jit
def _chunk_start(row0, col0, SLAB, F_B, O_B, PAIRS: tl.constexpr):
    """(k * C2 of the chunk's first element [1], its first word's offset) for the chunk at (row0,
    col0): the int64 index arithmetic, once a chunk."""
    start = row0 * SLAB + col0
    kc2 = ((((row0 * F_B + O_B + col0) & 0xFFFFFFFF) * 0x85EBCA77) & 0xFFFFFFFF).to(tl.uint32)
    return tl.full([1], 0, tl.uint32) + kc2, start >> 1 if PAIRS else start  # PAIRS: SLAB, col0 even


@triton.jit
def _chunk_full(row0, col0, A, SLAB, r, BLK: tl.constexpr, ITERS: tl.constexpr, ROW_ITERS: tl.constexpr):
    """Whether every element of the chunk at (row0, col0) is in the record: no masks."""
    if ROW_ITERS == 2:  # dense: a tile's slabs are whole
        return row0 + r * ITERS <= A
    elif ROW_ITERS == 1:
        return (row0 + ITERS <= A) & (col0 + BLK <= SLAB)
    else:
        return col0 + BLK * ITERS <= SLAB


@triton.jit
def _chunk_tiles(row0, col0, A, SLAB, r, BLK: tl.constexpr, ITERS: tl.constexpr, ROW_ITERS: tl.constexpr):
    """How many of the chunk's tiles hold an element (the others come after them), int32."""
    if ROW_ITERS:
        n = (A - row0 + r - 1) // r
    else:
        n = (SLAB - col0 + BLK - 1) // BLK
    return tl.minimum(n, ITERS).to(tl.int32)


@triton.jit
def _tile_mask(row0, col0, it, lane_row, lane_col, A, SLAB, r, BLK: tl.constexpr, ROW_ITERS: tl.constexpr):
    """[1, words] mask of tile `it` of the chunk at (row0, col0); lane_row / lane_col: each
    word's slab in the tile and first element's column in it (with PAIRS SLAB is even, so both
    halves of a word are in or both out)."""
    if ROW_ITERS == 2:
        m = (row0 + it * r + lane_row) < A
    elif ROW_ITERS == 1:
        m = ((row0 + it + lane_row) < A) & ((col0 + lane_col) < SLAB)  # lane_row 0: a vector
    else:
        m = (col0 + it * BLK + lane_col) < SLAB
    return m[None, :]


@triton.jit
def _stats_exact(w_ptr, A, SLAB, N_COL, TOTAL, NPROG, pid, WIDTH: tl.constexpr, IS_BF16: tl.constexpr,
                 BLK: tl.constexpr, ITERS: tl.constexpr, ROW_ITERS: tl.constexpr):
    """The statistics of a program's chunks with a finiteness test per element, reduced: the
    sums and max |x| of the finite elements and the non-finite count (the torch path's
    definition). Element by element, every tile masked, whatever the caller's words."""
    cc = tl.arange(0, BLK)
    if ROW_ITERS == 2:
        r = BLK // SLAB
        lane_row = cc // SLAB
        lane_col = cc - lane_row * SLAB
    else:
        r = 1
        lane_row = cc * 0
        lane_col = cc
    acc_s = tl.zeros([BLK], dtype=tl.float32)
    acc_q = tl.zeros([BLK], dtype=tl.float32)
    acc_m = tl.zeros([BLK], dtype=tl.float32)
    acc_n = tl.zeros([BLK], dtype=tl.int32)
    for chunk in range(pid, TOTAL, NPROG):
        rg = (chunk // N_COL).to(tl.int64)
        cg = (chunk % N_COL).to(tl.int64)
        row0, col0 = _chunk_origin(rg, cg, r, BLK, ITERS, ROW_ITERS)
        # a loop, not unrolled: a kernel's registers are those of its hungriest part, and this
        # rare path unrolled (ITERS tiles of loads in flight) set them for the whole kernel -
        # fewer programs an SM for every record, not just a poisoned one. bf16 word pairs, sm_90
        # (`probes sass`, Triton 3.6 on an H200 machine): whole tiles 72 -> 66 registers, 2048-wide
        # shards 113 -> 78 (this change alone); 512-wide 168 -> 64 with the dense tile
        for it in range(ITERS):
            if ROW_ITERS == 2:
                rows = row0 + it * r + lane_row
                cols = lane_col
            elif ROW_ITERS == 1:
                rows = row0 + it + lane_row
                cols = col0 + lane_col
            else:
                rows = row0 + lane_row
                cols = col0 + it * BLK + lane_col
            mask = (rows < A) & (cols < SLAB)
            raw = tl.load(w_ptr + rows * SLAB + cols, mask=mask, other=0)
            v = _as_f32(raw, WIDTH, IS_BF16)
            fin = tl.abs(v) <= 3.4028234663852886e38     # false for NaN and +-inf
            vf = tl.where(fin, v, 0.0)
            acc_s += vf
            acc_q += vf * vf
            acc_m = tl.maximum(acc_m, tl.abs(vf))
            acc_n += tl.where(fin, 0, 1)
    return tl.sum(acc_s, axis=0), tl.sum(acc_q, axis=0), tl.max(acc_m, axis=0), tl.sum(acc_n, axis=0)


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
