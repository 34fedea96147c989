"""exp2 partly in software, on the FMA pipe (AttnConfig.exp_soft): FlashAttention-4's way of
sharing a softmax's exponentials between the MUFU unit (16 exp2 a clock per SM on sm_90) and the
fp32 pipes (128 FMA a clock per SM), for loops where the MUFU pipe, not the tensor cores, may set
the pace (the D=64 backward: docs/benchmarks.md, "Invariant attention").

2^x = 2^j * 2^f with j = x rounded to the nearest integer and f = x - j in [-1/2, 1/2]: 2^f by a
polynomial (Horner, fp32 FMAs), then j added to its exponent bits as an integer. The rounding is
fp32 addition of 1.5 * 2^23 (the sum's low mantissa bits then hold j; no FRND, which may share the
MUFU's pipe); inputs below -127 give 0 (as the MUFU's flush-to-zero exp2 does there, give or take
2^-126).

Coefficients: minimax for the relative error of 2^f on [-1/2, 1/2] with p(0) = 1 (exact at whole
numbers), from a linear program on 4001 points, rounded to fp32. Relative error against float64
exp2, evaluated in fp32 (tests/test_attention_exp2.py checks it under the interpreter): degree 3
1.0e-4, 4 2.9e-6, 5 2.3e-7 - a bf16 P carries 2^-9 = 2.0e-3 (half its spacing) from its rounding
alone.

Which elements take the polynomial depends on the column index within the tile only (EVERY 2:
the odd columns, 4: a quarter of them - exp2_mixed), and a kernel's tiles are fixed per head_dim: every TP
degree, batch and sequence length the same elements, so invariance holds as for exp2 alone.

Imports Triton at import time: import this module lazily.
"""
from __future__ import annotations

import triton
import triton.language as tl

# lowest degree first; the constant term is 1 (p(0) = 1)
COEFFS = {3: (1.0, 0.6932829022407532, 0.2422109693288803, 0.055009059607982635),
          4: (1.0, 0.6931241154670715, 0.24024106562137604, 0.05590682849287987, 0.009582576341927052),
          5: (1.0, 0.6931465864181519, 0.24022166430950165, 0.055510472506284714, 0.009674952365458012,
              0.0013202981790527701)}
# the largest relative error of each degree against float64 exp2 (fp32 evaluation, no FMA)
MAX_REL_ERR = {3: 1.02e-4, 4: 2.9e-6, 5: 2.3e-7}
EVERY_CHOICES = (1, 2, 4)

_D3_1, _D3_2, _D3_3 = (tl.constexpr(c) for c in COEFFS[3][1:])
_D4_1, _D4_2, _D4_3, _D4_4 = (tl.constexpr(c) for c in COEFFS[4][1:])
_D5_1, _D5_2, _D5_3, _D5_4, _D5_5 = (tl.constexpr(c) for c in COEFFS[5][1:])


@triton.jit
def exp2_poly(x, DEG: tl.constexpr):
    """2^x by a degree-DEG polynomial (3, 4 or 5) and exponent bits: no MUFU instruction."""
    x = tl.maximum(x, -127.0)
    t = x + 12582912.0  # 1.5 * 2^23: fp32 rounds x to a whole number j, kept in t's low bits
    f = x - (t - 12582912.0)
    if DEG == 3:
        p = (_D3_3 * f + _D3_2) * f + _D3_1
    elif DEG == 4:
        p = ((_D4_4 * f + _D4_3) * f + _D4_2) * f + _D4_1
    else:
        p = (((_D5_5 * f + _D5_4) * f + _D5_3) * f + _D5_2) * f + _D5_1
    p = p * f + 1.0
    # j << 23: t's bits are 1.5 * 2^23's plus j, and 1.5 * 2^23's shifted out entirely
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_mixed(x, R: tl.constexpr, C: tl.constexpr, EVERY: tl.constexpr, DEG: tl.constexpr):
    """2^x of an [R, C] tile (C a multiple of 16 where EVERY is 4): some columns by exp2_poly, the
    others by tl.math.exp2 (MUFU). EVERY 0: all by exp2; 1: all by the polynomial; 2: the odd
    columns; 4: a quarter, c % 16 in (9, 11, 13, 15). The columns
    are split by reshape and tl.split (the halves of a size-2 last dimension), so each exp2 runs
    on the elements that take it only - a tl.where of both would run both on every element."""
    if EVERY == 0:
        y = tl.math.exp2(x)
    elif EVERY == 1:
        y = exp2_poly(x, DEG)
    elif EVERY == 2:
        a, b = tl.split(tl.reshape(x, [R, C // 2, 2]))
        y = tl.reshape(tl.join(tl.math.exp2(a), exp2_poly(b, DEG)), [R, C])
    else:
        # column 16a + 8b + 2d + u at [a, b, d, u] of [R, C/16, 2, 4, 2]: the odd columns (u = 1) of
        # the odd 8-column groups (b = 1), c % 16 in (9, 11, 13, 15). Not c % 4 == 3: a Hopper MMA
        # result gives each thread column pairs (2d, 2d + 1) of every 8-column group, so this
        # split stays within a thread's registers where c % 4 == 3 went through shared memory
        # (56 spill loads/stores in the D=64 dq pass: `--sass`)
        e, o = tl.split(tl.reshape(x, [R, C // 16, 2, 4, 2]))
        o0, o1 = tl.split(tl.permute(o, [0, 1, 3, 2]))
        o = tl.permute(tl.join(tl.math.exp2(o0), exp2_poly(o1, DEG)), [0, 1, 3, 2])
        y = tl.reshape(tl.join(tl.math.exp2(e), o), [R, C])
    return y


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
