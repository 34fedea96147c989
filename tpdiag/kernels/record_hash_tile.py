"""One tile's share of the record hash: the lane terms of its elements and its statistics
(CUDA; the Triton interpreter runs them on the CPU).

record_hash_triton.py's kernels walk a record's chunks tile by tile and hand each tile's raw words
here: _accum element by element, _accum_pairs for bf16 read as 32-bit word pairs. The lane mix is
record_hash.py's (its docstring defines the lanes); record_hash_ref.py is the torch path, bit for
bit the same. Imports Triton at import time: imported only by record_hash_triton.py.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from tpdiag.kernels.interpreter_patch import lighten

lighten()  # the interpreter's per-helper re-patching skipped (interpreter_patch.py)

# The word-pairs path has three bits of inline PTX (_high_k, _high_bits, _max_pairs). The
# interpreter runs no PTX, so there (the CPU's tests) the same values come from plain Triton ops;
# tests/test_benchmarks.py compiles the PTX path for sm_90 on the CPU, and `python -m benchmarks
# record-hash` checks it bit for bit on a GPU
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _accum_pairs(raw, mask, kc2, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m,
                 R: tl.constexpr, TW: tl.constexpr, EVEN: tl.constexpr, MIX: tl.constexpr):
    """The accumulators with tile words `raw` added: two bf16 a word, the low element at an even
    position whose k * C2 is kc2 [R] + cc_c2. Per word: the two elements' hash terms with one
    position add between them, the fp32 sums, and one max for both halves (_max_pairs). The sm_90
    loop: 11.2 instructions an element, against 12.6 for the word pairs before these changes and
    12.9 element by element (`probes sass`; docs/benchmarks.md has the H200 figures)."""
    wd = raw.to(tl.uint32, bitcast=True)
    pos = cc_c2 + kc2[:, None]
    # high element: h * C1 + (k + 1) * C2 = (h + K) * C1 + k * C2, K = C2 / C1 mod 2**32: both
    # elements share one position add, and h + K is one instruction (_high_k)
    hk = _high_k(wd)
    y0 = (wd & 0xFFFF) * c1 + pos
    y1 = hk * c1 + pos
    x0 = _mix(y0, c3, MIX)
    x1 = _mix(y1, c3, MIX)
    if not EVEN:
        x0 = tl.where(mask, x0, tl.zeros([R, TW], dtype=tl.uint32))
        x1 = tl.where(mask, x1, tl.zeros([R, TW], dtype=tl.uint32))
    acc_a += x0 + x1
    acc_b += x0 * _lane_b_factor(x0, y0, MIX)
    acc_b += x1 * _lane_b_factor(x1, y1, MIX)
    v = (wd << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32: the bits, shifted
    u = _high_bits(wd, hk).to(tl.float32, bitcast=True)
    acc_s += v
    acc_s += u
    acc_q += v * v
    acc_q += u * u
    if _PTX:
        acc_m = _max_pairs(acc_m, wd)
    else:
        acc_m = tl.maximum(acc_m, tl.maximum(tl.abs(v), tl.abs(u)))
    return acc_a, acc_b, acc_s, acc_q, acc_m


@triton.jit
def _high_k(wd):
    """(wd >> 16) + K, K = C2 * C1**-1 mod 2**32 = 0x1A63E8A7. In PTX, so that the compiler does
    not distribute (h + K) * C1 back into h * C1 + C2 - an add a word (`probes sass`)."""
    if _PTX:
        r = tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 16; add.u32 $0, t, 0x1A63E8A7; }",
                                      "=r,r", [wd], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        r = (wd >> 16) + 0x1A63E8A7
    return r


@triton.jit
def _high_bits(wd, hk):
    """wd & 0xFFFF0000 - the high element's fp32 bits - as (h + K) * 2**16 - K * 2**16: a
    multiply-add, off the integer/logic pipe the lane mix keeps busy."""
    if _PTX:
        r = tl.inline_asm_elementwise("mad.lo.u32 $0, $1, 65536, 0x17590000;", "=r,r", [hk],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        r = wd & 0xFFFF0000
    return r


@triton.jit
def _max_pairs(acc, wd):
    """max(|acc|, |wd|) per bf16 half, in one instruction a word (HMNMX2.BF16_V2.XORSIGN on sm_90;
    `probes sass`). The result's sign is the xor of the inputs' - the next max takes |acc| again,
    and the kernel's tail masks it off. A bf16 max is exact: the same max |x| as in fp32. NaN
    loses to a number here, as nowhere else matters: a non-finite element poisons the fp32 sums,
    and the statistics are then computed again element by element (_stats_exact)."""
    return tl.inline_asm_elementwise("max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [acc, wd],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _accum(raw, mask, kc2, cc_c2, c1, c3, acc_a, acc_b, acc_s, acc_q, acc_m,
           WIDTH: tl.constexpr, IS_BF16: tl.constexpr, R: tl.constexpr, TW: tl.constexpr,
           EVEN: tl.constexpr, MIX: tl.constexpr):
    """The accumulators with one tile added element by element: its raw words, its mask (not
    EVEN) and its rows' first positions times C2 (kc2 [R])."""
    pos = cc_c2 + kc2[:, None]
    if WIDTH == 16:
        w = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        w = raw.to(tl.uint32, bitcast=True)
    y = w * c1 + pos
    x = _mix(y, c3, MIX)
    if not EVEN:
        x = tl.where(mask, x, tl.zeros([R, TW], dtype=tl.uint32))
    acc_a += x
    acc_b += x * _lane_b_factor(x, y, MIX)
    v = _as_f32(raw, WIDTH, IS_BF16)
    acc_s += v
    acc_q += v * v
    acc_m = tl.maximum(acc_m, tl.abs(v))
    return acc_a, acc_b, acc_s, acc_q, acc_m


@triton.jit
def _mix(y, c3, MIX: tl.constexpr):
    """The lane mix of y = w * C1 + k * C2 (record_hash.py's docstring). 2: y ^ rotl(y, 7) ^
    rotl(y, 19) (two funnel shifts and one 3-input xor); 1: the first mix, for the benchmarks'
    side-by-side timing. (Version 1's right shifts as inline-PTX mul.hi were 6-17% slower on
    an H200: `git show d055ef2:docs/benchmarks.md`, "Second round".)"""
    if MIX == 2:
        return y ^ ((y << 7) | (y >> 25)) ^ ((y << 19) | (y >> 13))
    else:
        x = y ^ (y >> 16)
        x = x * c3
        return x ^ (x >> 15)


@triton.jit
def _lane_b_factor(x, y, MIX: tl.constexpr):
    """lane_b's term is x * y in version 2 (x * x in version 1): a square's low bits repeat
    lane_a's (x * x = x mod 2; odd squares are 1 mod 8)."""
    if MIX == 2:
        return y
    else:
        return x


@triton.jit
def _as_f32(raw, WIDTH: tl.constexpr, IS_BF16: tl.constexpr):
    if WIDTH == 32:
        return raw.to(tl.float32, bitcast=True)
    elif IS_BF16:
        return raw.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return raw.to(tl.float16, bitcast=True).to(tl.float32)


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
