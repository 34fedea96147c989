"""Record hashing for hash-first capture: order-aware lanes and float64 statistics of a tensor
SHARD that add up to those of the WHOLE tensor, computed where the shard lives.

Definition, version 2 (HASH_VERSION; for the whole tensor - a shard computes its share from
its elements' GLOBAL indices). Each element's raw bits w (zero-extended to 32 bits; 64-bit
elements are two 32-bit words, so indices count words) and its row-major index k (mod 2**32) give

    y = w * C1 + k * C2;  x = y ^ rotl(y, 7) ^ rotl(y, 19)          (all mod 2**32)
    lane_a = sum(x) mod 2**32,  lane_b = sum(x * y) mod 2**32

One changed element always changes lane_a: for fixed k, w -> y is a bijection (C1 is odd), and
y -> x is one too - a GF(2)-linear map whose polynomial 1 + t**7 + t**19 is a unit of
GF(2)[t] / (t**32 + 1) = GF(2)[t] / ((t + 1)**32), since it is 1 at t = 1 (an odd number of
terms) - so the element's term changes and no other term does. Sums are associative and
commutative, so the shares of the shards add up to the lanes of the gathered tensor without
gathering it, in any order, on any device. What the mix buys and what it does not
(benchmarks/jobs/hash_collisions.py; `git show d055ef2:docs/benchmarks.md`, "A shorter lane mix"): y is linear in
w and k, so the xor of two rotations is the only step that is not (carries make xor and + differ);
perturbations of many elements (rounding differences, permutations, shard offsets, a sign flip
of the tensor) leave 8-bit windows of both lanes unchanged at a random function's rate, but
changes confined to TWO elements (a swap, a balanced +-1 ULP pair, two sign flips) leave lane_a
unchanged 2-3x as often as a random function's at 8 bits and up to ~34x at 20 bits; lane_b
(x * y: a product, not a square, whose low bits would repeat lane_a's) stays near random there,
so the pair is what carries such changes. Integer work per element: one multiply-add, two funnel
shifts, one 3-input xor, an add and a multiply-add for the lanes. At 2 bytes an element that
work, not memory, bounded the bf16 loop until it read 32-bit words of two elements with one max
for both (`python -m benchmarks probes sass`; an H200 now hashes bf16 at torch.sum's speed).

Version 1 (run directories written before the field existed; `mix=1` for the benchmarks' A/B and
for checking an old directory's stored tensors): x = y ^ (y >> 16); x *= C3; x ^= x >> 15;
lane_b = sum(x * x). Two more integer ops per element; lane_a near random in every class above,
lane_b's low bits tied to lane_a's (a square is x mod 2 in its last bit, odd squares are 1 mod 8).
Hashes of the two versions differ for equal tensors: records/hashing.py refuses to compare them.

Statistics: the count of non-finite values, the sum and sum of squares of the finite ones and
their max |x| - fp32 within a block, float64 across blocks.

A shard is described by its slab layout: view the local tensor as [A, L, B] around the sharded
dim d (A = prod(local[:d]), L = local[d], B = prod(local[d+1:])); local (a, l, b) is global
a * (F * B) + (o + l) * B + b for the full size F of dim d and this rank's offset o. Within one
slab `a` the global indices are contiguous, so the kernel needs no division per element.

Layout: `_hash_kernel` and `_hash_batch_kernel` (many records in one launch) in
record_hash_triton.py (Triton, CUDA; 16- and 32-bit floats), `lanes_torch` (record_hash_ref.py:
every dtype and device, the CPU path, the same lanes bit for bit), `shard_lanes` (dispatch),
`batch_entry` / `batch_launch` (the batched launch, record_hash_batch.py; HashBuffer in
kernels/hash_buffer.py queues records for it).
"""
from __future__ import annotations

import functools
import os

import torch

from tpdiag.kernels.record_hash_ref import (C1, C2, C3, HASH_VERSION, M32, MIXES, lanes_fast, lanes_torch,  # noqa: F401
                                            reference_lanes)

# Launch shape (none of it changes the lanes; the float sums may differ in their last bits).
# A chunk is CHUNK = BLOCK * ITERS elements: ITERS blocks along one slab, or for slabs narrower
# than a chunk (a last-dim shard: one slab per row) a [R, CB] tile of R slabs, so that a
# 512-wide shard does not leave 7/8 of the lanes masked. WAVES: programs per SM.
BLOCK, ITERS, WAVES, WARPS = 1024, 8, 4, 4   # H200 sweep: docs/scale.md
# 2-byte data: twice the elements per byte, so a chunk twice as long (H200, session 9, 1 GiB
# bf16: 3187 -> 3342 GB/s whole, 3115 -> 3296 / 2916 -> 3115 in 2048- / 512-wide shards; fp32
# at 16 was slower, 4042 -> 3589: `git show d055ef2:docs/benchmarks.md`, "Session 9")
ITERS_2BYTE = 16
# 16-bit records, programs per SM for each record of a launch (TPDIAG_HASH_WAVES16 for A/B), and
# at least FILL_2BYTE per SM in the whole launch. At 4 an SM holds 16 warps and its schedulers
# find no eligible warp 32-41% of cycles (ncu, H200): a record hashed alone reads faster at 16
# (H200, 1 GiB bf16, lean word pairs, 62cadff: whole 3707 -> 3911 GB/s, last-dim shard 3579 ->
# 3861). A training step's launches hold several records, whose programs run side by side, and
# there 16 a record was not faster (llama-1b 8 x 4096, same run: +20.8 ms a step against +16.0 at
# 4, one 7-round comparison; session 11 saw the same with the first word pairs; the hash kernels'
# time in a profiled step was the same 18.5 ms with the fill rule and at a fixed 4): 4 a record,
# 16 a launch.
WAVES_2BYTE_DEFAULT = 4
FILL_2BYTE = 16


def iters_for(width: int) -> int:
    return ITERS_2BYTE if width == 16 else ITERS


def knob_int(name: str, default: int, hi: int, lo: int = 1) -> int:
    """An integer A/B knob from the environment (lo..hi; unset or empty: default); a bad value is
    BadInput, the CLI's one line."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not v.isdigit() or not lo <= int(v) <= hi:
        from tpdiag.errors import BadInput

        raise BadInput(f"{name}={v!r}: expected an integer from {lo} to {hi}")
    return int(v)


_WAVES_2BYTE: list = []
# Narrow tiles (ROW_ITERS: a last-dim shard narrower than a chunk): where a register cap (Triton's
# maxnreg) reads faster. Measured side by side on an H200 (`probes hash`, 1 GiB, median of 5
# interleaved rounds, 19e1ab3 - after the kernel's registers stopped being set by its rare
# statistics path): fp32 strided tiles (2048 wide) 4280 GB/s capped at 96 against 4104 uncapped
# (session 17: +4-5% in three calls); fp32 dense tiles (512 wide, one register row since 19e1ab3)
# 4284 uncapped against 3116 capped (range 3112-3125; not explained: `probes sass` shows the capped
# loop at 94 registers, 5 programs an SM, 10.84 instructions an element, no spills);
# bf16 dense word pairs 3955 capped (79 registers) against 3725 uncapped (64) - ranges overlap, and
# identical launches in two rows of that call read 3918 and 3813; bf16 strided tiles run uncapped
# (session 17: capped they spilled and lost). 16-bit data read element by element (fp16; bf16
# below sm_86 or unaligned) would spill 83-126 local accesses a chunk under a cap of 96 (sm_90,
# Triton 3.9's ptxas on the CPU, probes_sass.loop_mix; not timed), so
# it runs uncapped. TPDIAG_HASH_NARROW_REGS: a cap for every narrow tile (255: none; A/B).
NARROW_REGS_DEFAULT = 96
_NARROW_REGS: list = []


def narrow_regs_knob() -> int:
    """TPDIAG_HASH_NARROW_REGS (32..255, 255: no cap; ptxas cannot fit the loop in fewer than 32;
    0: not set), read now (compare's input checks; narrow_regs caches it)."""
    return knob_int("TPDIAG_HASH_NARROW_REGS", 0, 255, lo=32)


def narrow_regs(row_iters, width: int, pairs: bool) -> int | None:
    """The register cap (Triton's maxnreg) of a launch with these tiles (ROW_ITERS) of `width`-bit
    elements, read as word pairs or not (the kernel's effective PAIRS); None: no cap. By default
    32-bit strided tiles and 16-bit dense word pairs (what an H200 read faster, above)."""
    if not row_iters:
        return None
    if not _NARROW_REGS:  # parsed once: asked per launch (host time)
        _NARROW_REGS.append(narrow_regs_knob())
    cap = _NARROW_REGS[0]
    if cap:
        return cap if cap < 255 else None
    if (width == 32 and row_iters == 1) or (width == 16 and row_iters == 2 and pairs):
        return NARROW_REGS_DEFAULT
    return None


def waves_for(width: int, records: int = 1) -> int:
    """Programs per SM for each of `records` records launched together."""
    if width != 16:
        return WAVES
    if not _WAVES_2BYTE:  # parsed once: asked per launch (host time)
        w = knob_int("TPDIAG_HASH_WAVES16", 0, 64)
        # an explicit TPDIAG_HASH_WAVES16 is that many a record, whatever the launch (A/B)
        _WAVES_2BYTE[:] = [w, w] if w else [WAVES_2BYTE_DEFAULT, FILL_2BYTE]
    per, fill = _WAVES_2BYTE
    return max(per, -(-fill // max(1, records)))


@functools.lru_cache(maxsize=1)
def _triton():
    """The kernels' module (record_hash_triton.py), imported on first use: Triton is heavy."""
    from tpdiag.kernels import record_hash_triton

    return record_hash_triton


_AVAILABLE: list = []


def _available() -> bool:
    # cached: asked once per record (host time per record)
    if not _AVAILABLE:
        try:
            _triton()
            _AVAILABLE.append(True)
        except Exception:
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


# --------------------------------------------------------------------------------------
# torch wrappers
# --------------------------------------------------------------------------------------
_TORCH_ONLY = os.environ.get("TPDIAG_HASH_TORCH") == "1"  # bisecting: the torch path on CUDA too
_TRITON_T = {torch.float32: (32, torch.int32), torch.bfloat16: (16, torch.int16),
             torch.float16: (16, torch.int16)}


def slab(local_shape, dim: int | None, full: int | None, offset: int) -> tuple[int, int, int, int, int]:
    """(A, L, B, F, o) of a shard of `local_shape` split on `dim` (None: a whole tensor)."""
    shape = list(local_shape) or [1]
    if dim is None:
        n = 1
        for s in shape:
            n *= s
        return 1, n, 1, n, 0
    a = 1
    for s in shape[:dim]:
        a *= s
    b = 1
    for s in shape[dim + 1:]:
        b *= s
    return a, shape[dim], b, full, offset


def plan(a: int, slab_n: int, block: int = BLOCK, iters: int = ITERS) -> tuple[int, int, int, int, int, bool]:
    """(R, CB, ROW_ITERS, row groups, column groups, EVEN) for `a` slabs of `slab_n` elements:
    a tile is R x CB = block elements, a chunk `iters` tiles. ROW_ITERS (the kernels' one
    layout constexpr): 0, tiles along the slab - slabs of a chunk or more (whole tensors, first-dim
    shards); 1, one tile a slab, stacked over the slabs (R 1, CB block; a shorter whole tensor is
    one such slab, its chunks one tile each, hashed by as many programs); 2, dense - A > 1 slabs
    a power of two up to `block` long, R = block / CB whole slabs a tile, the chunk contiguous.
    EVEN (every chunk full) is the kernels' runtime branch, not a variant: a record meets one
    compiled variant of its dtype and layout whatever its sizes (a fresh machine compiled each
    (R, CB, EVEN, ...) it met inside the first worlds, docs/scale.md)."""
    if slab_n >= block * iters:
        r, cb, row_iters = 1, block, 0
        n_row, n_col = a, -(-slab_n // (block * iters))
        even = slab_n % (block * iters) == 0
    elif a > 1 and slab_n <= block and slab_n & (slab_n - 1) == 0:
        cb = max(slab_n, 1)
        r, row_iters = block // cb, 2
        n_row, n_col = -(-a // (r * iters)), 1
        even = a % (r * iters) == 0
    else:
        r, cb, row_iters = 1, block, 1
        n_row, n_col = -(-a // iters), -(-slab_n // block)
        even = slab_n % block == 0 and a % iters == 0
    return r, cb, row_iters, n_row, max(1, n_col), even


def triton_lanes(t: torch.Tensor, a: int, L: int, b: int, F: int, o: int, out=None, *,
                 block: int = BLOCK, iters: int | None = None, waves: int | None = None, warps: int = WARPS,
                 pairs: bool | None = None, mix: int = HASH_VERSION):
    """One launch: the shard's lanes and statistics into `out` - (ints [4] int64, floats [2]
    float64) or (ints [n, 4], floats [n, 2], row), zeroed - allocated here when None.
    block / iters / waves / warps: launch shape (benchmarks); pairs: _hash_chunks' PAIRS code
    path where the data allows it (default: PAIRS[0]); the lanes never depend on any of them.
    mix: the hash version (HASH_VERSION; 1 for an old run directory or the benchmarks' A/B)."""
    if mix not in MIXES:
        raise ValueError(f"unknown record-hash mix {mix!r} (known: {MIXES})")
    width, iview = _TRITON_T[t.dtype]
    iters = iters_for(width) if iters is None else iters
    waves = waves_for(width) if waves is None else waves
    words = t.contiguous().view(iview)
    if out is None:
        out = (torch.zeros(4, dtype=torch.int64, device=t.device),
               torch.zeros(2, dtype=torch.float64, device=t.device))
    ints, floats, row = out if len(out) == 3 else (out[0], out[1], 0)
    slab_n = L * b
    r, cb, row_iters, n_row, n_col, even = plan(a, slab_n, block, iters)
    total = n_row * n_col
    nprog = min(total, waves * _sm_count(t.device))
    args = (words, ints, floats, row, a, slab_n, F * b, o * b, n_col, total, nprog,
            width, t.dtype == torch.bfloat16, block, iters, row_iters,
            bool(PAIRS[0] if pairs is None else pairs) and t.dtype == torch.bfloat16 and slab_n % 2 == 0
            and words.data_ptr() % 4 == 0 and pairs_ok(t.device), mix)
    _launch(args, nprog, warps, t.device)
    return out


# Launch without Triton's generic Python path. A record's hash is one small kernel and a step
# has ~1000 records; on an H200 host Triton's dispatch (bind, specialise, key, look up) was
# 16.6 us of Recorder.add's 30.8 us - the probes' host time is what a small step pays. The
# kernel compiled for a key is launched directly; the key holds everything Triton specialises
# on for these arguments: the constexprs, num_warps, the device, each pointer's 16-byte
# alignment, SLAB (the one specialised integer: == 1, % 16) and whether every integer fits in
# int32 (its argument type).
_COMPILED: dict = {}
# bf16 data as 32-bit word pairs (_hash_chunks' PAIRS, where a record's layout allows it; the
# lanes are the same). On since 62cadff's lean word pairs: H200, 1 GiB bf16, side by side, whole
# 3707 GB/s against 3474 element by element at 4 per SM, 3911 against 3446 at 16; in a llama-1b
# 8 x 4096 step the hash kernels took 18.5 / 19.1 ms against 20.5 / 20.8 - less than the step's
# own spread, which could not tell the two apart (`git show d055ef2:docs/benchmarks.md`, "Session 16").
# TPDIAG_HASH_PAIRS=0: element by element (A/B).
PAIRS = [os.environ.get("TPDIAG_HASH_PAIRS", "1") != "0"]


@functools.lru_cache(maxsize=None)
def pairs_ok(device) -> bool:
    """Whether the word-pairs path compiles for `device`: its packed max (max.xorsign.abs.bf16x2)
    needs sm_86 or later (an A100, sm_80, hashes element by element). The interpreter runs no PTX."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 6)
_FAST = [os.environ.get("TPDIAG_HASH_FASTLAUNCH", "1") != "0"]


def _launch(args, nprog: int, warps: int, device) -> None:
    words, slab_n = args[0], args[5]
    small = max(args[3:11]) < 2**31
    regs = narrow_regs(args[15], args[11], args[16])
    key = ("one", device.index, args[11:], warps, words.data_ptr() % 16 == 0,
           args[1].data_ptr() % 16 == 0, args[2].data_ptr() % 16 == 0, slab_n == 1,
           slab_n % 16 == 0, small, regs)
    _direct(key, (nprog, 1, 1), args, device, lambda: _triton()._hash_kernel[(nprog,)](
        *args[:11], WIDTH=args[11], IS_BF16=args[12], BLK=args[13], ITERS=args[14],
        ROW_ITERS=args[15], PAIRS=args[16], MIX=args[17], num_warps=warps,
        **_cap(regs, device)))


def _direct(key, grid, args, device, jit_launch) -> None:
    """Launch the kernel compiled for `key` directly; the first time, through Triton's JIT
    (jit_launch), keeping what it compiled."""
    k = _COMPILED.get(key) if _FAST[0] else None
    if k is not None:
        k[grid](*args, stream=torch._C._cuda_getCurrentRawStream(device.index))
        return
    k = jit_launch()
    if _FAST[0] and device.type == "cuda" and hasattr(k, "__getitem__"):
        _COMPILED[key] = k


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def shard_lanes(t: torch.Tensor, dim: int | None = None, full: int | None = None, offset: int = 0,
                out=None, *, mix: int = HASH_VERSION, stats: bool = True):
    """(ints [lane_a, lane_b, nonfinite, absmax as float64 bits] int64 - lanes not yet reduced
    mod 2**32 -, floats [sum, sumsq] float64), on t's device, without a host sync. dim/full/
    offset place the shard in the whole tensor; `out`: where to add them (zeroed) - a HashBuffer
    slot (ints [n, 4], floats [n, 2], row) or a pair of rows (ints [4], floats [2]). mix: the
    hash version (an old run directory's: records/hashing.py). stats=False: the CPU skips the
    statistics (ints[2:] and floats zero); the GPU paths compute them anyway."""
    a, L, b, F, o = slab(t.shape, dim, full, offset)
    t = plain(t)
    if triton_ok(t):
        return triton_lanes(t, a, L, b, F, o, out, mix=mix)
    if t.is_cuda:  # whole-tensor torch ops: no host sync (lanes_fast syncs once a chunk)
        return lanes_torch(t, a, L, b, F, o, out, mix=mix)
    # stats=False: the lanes alone (the CPU's statistics are a pass of their own)
    return lanes_fast(t, a, L, b, F, o, out, mix=mix, stats=stats)


def plain(t: torch.Tensor) -> torch.Tensor:
    """t with storage of its own. A functional collective's result (AsyncCollectiveTensor,
    what DTensor.to_local() can return right after a redistribute) is a wrapper with none: a raw
    pointer handed to a kernel is not its data (an illegal access on an H200). Wait for it."""
    if type(t) is not torch.Tensor:
        wait = getattr(t, "wait", None)
        t = wait() if callable(wait) else t
    return t


def triton_ok(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take t (other subclasses go through torch dispatch). Not a
    single element (the loss, a grad norm): Triton specialises SLAB == 1, a variant of each kernel
    and dtype that a fresh machine compiled for a handful of records (`python -m benchmarks
    hash-variants`); the torch path's few small ops hash it, the same lanes."""
    return (type(t) is torch.Tensor and t.is_cuda and t.dtype in _TRITON_T and t.numel() >= TRITON_MIN_NUMEL
            and not _TORCH_ONLY and _available())


TRITON_MIN_NUMEL = 2


def _cap(regs: int | None, device) -> dict:
    """Triton's launch option for a register cap, on CUDA (the interpreter has no registers)."""
    return {"maxnreg": regs} if regs is not None and device.type == "cuda" else {}
