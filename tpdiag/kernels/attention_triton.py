"""The Triton path of invariant attention (CUDA; the Triton interpreter runs it on the CPU):
the tiles, the helpers both directions share, and the forward (the backward:
attention_triton_bwd.py).

Why it is invariant: one program per (batch, head, row block) - the grid only gets longer with
more heads or batch rows, and a program reads nothing but its own head's rows, with tiles fixed
per (head_dim, dtype), never per B or H. The forward walks every key block from 0 upwards into
one fp32 accumulator (never split-KV). fp32 inputs use IEEE fp32 products (no TF32). The launch
order (AttnConfig's *_group: heads per scheduling group, each group's heaviest causal blocks
first) moves no bit: no program's sums depend on it. Imports Triton at import time: import this
module lazily.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tpdiag.errors import BadInput
from tpdiag.kernels.exp2_soft import exp2_mixed
from tpdiag.kernels.interpreter_patch import lighten

lighten()  # the interpreter's per-helper re-patching skipped (interpreter_patch.py)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig:
    # defaults: the fastest tiles of a sweep on an H100 at B8 S4096 H32 D64 bf16 causal
    # (docs/benchmarks.md, "Invariant attention")
    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    kv_m: int = 64      # dk/dv pass: query rows per step
    kv_n: int = 64      # dk/dv pass: keys per program
    kv_warps: int = 4
    kv_stages: int = 3
    q_m: int = 128      # dq pass: query rows per program
    q_n: int = 64       # dq pass: keys per step
    q_warps: int = 4
    q_stages: int = 3
    # launch order only, never a bit: heads per scheduling group, each group's heaviest causal
    # blocks first (_block_and_head)
    fwd_group: int = 1
    kv_group: int = 1
    q_group: int = 1
    # > 0: the backward stores dS (the input dtype) from the dk/dv pass and dq reads it back (5
    # block products, not 7), heads in chunks whose dS fits in this many MiB (a KV head's query
    # heads always together; where one query head's does not fit, dq recomputes); 0: dq
    # recomputes P and dP. The chunking moves no bit (a head's sums are its own); the two paths
    # gave the same bits on an H100 and an H200 (docs/benchmarks.md, "Invariant attention");
    # either way the choice depends on L, S, dtype and this budget, never on B, H or H / Hk.
    ds_mib: int = 0
    # the forward loads Q, K, V and stores O by TMA descriptors where the chip and the layout
    # allow (tma_ok): the same bits as pointer loads
    fwd_tma: bool = True
    # the backward's loops load q, dO (dk/dv pass) and K (dq from dS) by TMA descriptors likewise
    bwd_tma: bool = False
    # warps of the dq pass that reads dS back (0: q_warps; its tiles are q_m x q_n)
    qds_warps: int = 0
    # the recompute backward (ds_mib = 0, or dS over budget) in one launch: delta by its own small
    # pass first (as the stored-dS path's), then the dk/dv programs and the dq programs side by
    # side in one grid, at the dk/dv pass's warps and stages. Each program's sums and their order
    # are the two-launch path's (invariant as those are); where the warps and stages are the dq
    # pass's too (the D=64 tiles) its bits should be too - the attention job checks (same_bits)
    bwd_fused: bool = False
    # > 1 (with ds_mib): the stored-dS backward keeps the dS of every ds_every-th key block of the
    # dk/dv pass only and its dq recomputes the others - dS traffic traded for products where both
    # alone leave the other resource idle (D=64); where stored it is the recompute's bf16 dS, so
    # the bits should not move. By key-block index only: every TP degree and batch the same
    ds_every: int = 0
    # exp2 partly by a polynomial on the FMA pipe beside the MUFU (kernels/exp2_soft.py): a bitmask
    # of the loops that do it - 1 the dq recompute loop, 2 the dk/dv loop, 4 the forward - where
    # 1 in exp_soft_every columns of the tile (1 every column, 2 the odd ones, 4 a quarter:
    # exp2_mixed) take a polynomial of degree exp_soft_deg (3, 4, 5). Other bits than exp2's,
    # still invariant (by column within a tile only); the MUFU may bound the D=64 backward
    # (`--sass`), not measured yet: off (issue 59 item 4). The stored-dS paths' dq keeps exp2
    exp_soft: int = 0
    exp_soft_every: int = 2
    exp_soft_deg: int = 3
    # the dq recompute loop loads K and V by TMA descriptors where tma_ok (the same bits as
    # pointer loads; issue 59 item 4's D=64 candidates, docs/benchmarks.md)
    dq_tma: bool = False
    # > 0: the backward's dk/dv pass (kv_persist) or dq recompute pass (q_persist) launches that
    # many programs per SM, and each takes the next tile (block, head) in the launch order
    # (heaviest causal blocks first: a greedy longest-first schedule) from a counter until none is
    # left. A tile's sums are the one-program-a-tile path's whichever program takes it: the
    # counter moves no bit. (The persistent dq program spills at the D=64 tiles: `--sass`)
    kv_persist: int = 0
    q_persist: int = 0
    # > 0: a register cap per thread (Triton's maxnreg) for the dk/dv and dq recompute passes: at
    # the D=64 tiles the dk/dv program takes 255 registers and the dq program 244 (`--sass`), 2
    # programs of 4 warps per SM; kv_m = 32 under 168 (or q_m = 64 under 128) fits 3 (4) without
    # spilling in the loops (ptxas for sm_90 on the CPU). Registers move no bit
    kv_maxnreg: int = 0
    q_maxnreg: int = 0
    # the recompute dk/dv pass takes each kv_m-row step as two halves whose products interleave
    # (attention_triton_bwd_programs._dkdv_inner_split): the same products into the same
    # accumulators in the same order. Not where the pass stores dS or takes exp_soft
    kv_split: bool = False

    def __post_init__(self):
        # the causal loops split at the diagonal on block boundaries
        if self.fwd_m % self.fwd_n or self.kv_n % self.kv_m or self.q_m % self.q_n:
            raise ValueError(f"AttnConfig {self}: fwd_m, kv_n and q_m must be multiples of fwd_n, kv_m, q_n")
        if (min(self.fwd_group, self.kv_group, self.q_group) < 1
                or min(self.ds_mib, self.qds_warps, self.ds_every, self.kv_persist, self.q_persist, self.kv_maxnreg,
                        self.q_maxnreg) < 0):
            raise ValueError(f"AttnConfig {self}: the groups must be >= 1, ds_mib, qds_warps, ds_every and "
                             "the persists and maxnregs >= 0")
        if self.kv_split and self.kv_m % 32:
            raise ValueError(f"AttnConfig {self}: kv_split needs kv_m a multiple of 32 (halves of 16 rows or more)")
        if self.ds_every > 1 and self.kv_n % self.q_n:
            # a dq step must lie within one dk/dv key block, whose dS is kept or not as a whole
            raise ValueError(f"AttnConfig {self}: ds_every needs kv_n a multiple of q_n")
        if not 0 <= self.exp_soft < 8 or self.exp_soft_every not in (1, 2, 4) or self.exp_soft_deg not in (3, 4, 5):
            raise ValueError(f"AttnConfig {self}: exp_soft a bitmask of 1, 2, 4; exp_soft_every 1, 2 or 4; "
                             "exp_soft_deg 3, 4 or 5")
        cols = [n for bit, n in ((1, self.q_n), (2, self.kv_m), (4, self.fwd_n)) if self.exp_soft & bit]
        if self.exp_soft_every == 4 and any(n % 16 for n in cols):
            # a quarter is 4 columns of every 16 (exp2_mixed)
            raise ValueError(f"AttnConfig {self}: exp_soft_every 4 needs the soft loops' column tiles "
                             "(q_n, kv_m, fwd_n) multiples of 16")

    def soft(self, loop: int) -> int:
        """The exp2_mixed EVERY of a loop (1 dq, 2 dk/dv, 4 forward): 0 where it keeps exp2."""
        return self.exp_soft_every if self.exp_soft & loop else 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# Tiles fixed per dtype and head_dim (never per B, H or sequence length): fp32 tiles are smaller
# (IEEE fp32 dots).
CONFIGS = {torch.bfloat16: AttnConfig(), torch.float16: AttnConfig(),
           torch.float32: AttnConfig(64, 32, 4, 2, 32, 64, 4, 2, 64, 32, 4, 2)}
# head_dim 128 (Llama 3, Qwen3): the D=64 tiles spill there (fwd+bwd 1.84x cuDNN on an H200);
# a sweep at B4 S4096 H16 D128 bf16 (docs/benchmarks.md) chose these. head_dim is never sharded,
# so a tile choice by head_dim keeps every TP degree and batch on the same tiles.
# The dq pass there launches its row blocks 4 heads at a time (q_group): 3% faster on an H100
# than head by head; all 16 or 64 heads at once thrash L2 (docs/benchmarks.md).
# dS is stored there (ds_mib): 5 block products in the backward instead of 7, for 2 GiB of scratch
# at most (64 heads at S = 4096 in one chunk: smaller chunks leave the GPU idle at each chunk's
# tail). The backward's loops load by TMA there (bwd_tma): 1.67 vs 1.74-1.76 ms on an H200 (at
# D=64 no faster). With TMA loads the dq pass that reads dS back is 18% faster at 4 warps than
# at 8 (qds_warps); the recompute dq (where one head's dS exceeds the budget) stays at 8, 1.4x
# faster there. The forward and the dk/dv pass launch 4 heads per scheduling group (fwd_group,
# kv_group): 8% and 1-2% faster than head by head with TMA loads on an H200 (docs/benchmarks.md).
# head_dim 64 (Llama 3.2 1B/3B, many smaller models): the default tiles, with D=128's 4-head launch
# groups and TMA loads in the backward's loops, the dq recompute loop's K and V too (dq_tma): the
# same bits, 1.2-2.3% faster than without them side by side in three calls on an H200 (d6af97d,
# ca8a16f, 00c7597; docs/benchmarks.md). dq recomputes there: its
# dS would be 8 GiB at B8 H32 S4096 and its traffic costs more than the two products it saves
# (docs/benchmarks.md, "Invariant attention"). The one-launch recompute backward (bwd_fused, the
# same bits) is not the default: 1.088x cuDNN against 1.115x in a sweep on one H200, but 1.132x
# against 1.111-1.117x side by side twice on another (0d4236d / d6e0c86, docs/benchmarks.md).
D128 = AttnConfig(128, 128, 8, 3, 64, 64, 4, 2, 128, 64, 8, 3, fwd_group=4, kv_group=4, q_group=4, ds_mib=2048,
                  bwd_tma=True, qds_warps=4)
D64 = AttnConfig(fwd_group=4, kv_group=4, q_group=4, bwd_tma=True, dq_tma=True)
HEAD_DIM_CONFIGS = {(dt, d): cfg for dt in (torch.bfloat16, torch.float16) for d, cfg in ((64, D64), (128, D128))}
DS_MIB_ENV = "TPDIAG_ATTENTION_DS_MIB"  # a smaller dS budget (0: recompute), where memory is short


def config_for(dtype: torch.dtype, head_dim: int) -> AttnConfig:
    cfg = HEAD_DIM_CONFIGS.get((dtype, head_dim)) or CONFIGS[dtype]
    budget = os.environ.get(DS_MIB_ENV, "").strip()
    if cfg.ds_mib and budget:
        if not (budget.isascii() and budget.isdigit()):
            raise BadInput(f"{DS_MIB_ENV}={budget!r}: expected a whole number of MiB (0: dq recomputes)")
        cfg = replace(cfg, ds_mib=min(cfg.ds_mib, int(budget)))
    return cfg


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    if PREC == "up":
        # the Triton interpreter (3.9) gets 16-bit tl.dot wrong: upcast there. The products of
        # 16-bit values are exact in fp32, so only the fp32 accumulation order can differ.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _load_rows(base, rows, stride, offs_d, n, EVEN: tl.constexpr, I64: tl.constexpr):
    """Rows `rows` (each D wide, `stride` apart) of the block at base; rows >= n read as 0 unless
    EVEN (every block full: no mask). I64: row offsets in int64 - one batch row of q in
    [B, L, H, D] memory passes 2^31 elements at L * H * D (e.g. L = 262144, H = 64, D = 128); only
    there (wide()): int64 row offsets cost the pointer paths 4-5% on an H200 (docs/benchmarks.md)."""
    if I64:
        ptrs = base + rows[:, None].to(tl.int64) * stride + offs_d[None, :]
    else:
        ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=rows[:, None] < n, other=0.0)


@triton.jit
def _tile(src, b, h, start, rows, stride, offs_d, n, R: tl.constexpr, D: tl.constexpr,
          EVEN: tl.constexpr, I64: tl.constexpr, TMA: tl.constexpr):
    """R rows from `start` (rows = start + arange(R)) of head (b, h): TMA: `src` is a [B, H, N, D]
    descriptor (rows past n read as 0); else this head's base pointer (_load_rows). The same
    bits either way."""
    if TMA:
        return tl.reshape(src.load([b, h, start, 0]), [R, D])
    else:
        return _load_rows(src, rows, stride, offs_d, n, EVEN, I64)


@triton.jit
def _block_and_head(NB, BH, G):
    """(block, batch * head) of this program in a 1-D grid of BH * NB: heads in groups of G, each
    group's blocks largest-work first (block NB - 1 - rank for the row-block passes; the caller
    turns it round for the dk/dv pass). Only the launch order moves: what a program computes
    does not depend on it."""
    return _block_and_head_at(tl.program_id(0), NB, BH, G)


@triton.jit
def _block_and_head_at(pid, NB, BH, G):
    # _block_and_head of program `pid` of its pass (a launch may hold two passes: bwd_fused)
    g0 = (pid // (G * NB)) * G
    gn = tl.minimum(G, BH - g0)
    r = pid - g0 * NB
    return NB - 1 - r // gn, g0 + r % gn


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, lo, hi, S, qk_scale,
               DIAG: tl.constexpr, EVEN: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr, I64: tl.constexpr, BM: tl.constexpr, SOFT: tl.constexpr,
               DEG: tl.constexpr):
    # key blocks lo, lo+BN, ... < hi in ascending order; DIAG: blocks that need the causal mask.
    # TMA: k_src / v_src are [B, Hk, S, D] descriptors (rows past S read as 0), else this head's
    # base pointers
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        cols = start_n + offs_n
        k = _tile(k_src, b, hk, start_n, cols, skn, offs_d, S, BN, D, EVEN, I64, TMA)
        v = _tile(v_src, b, hk, start_n, cols, svn, offs_d, S, BN, D, EVEN, I64, TMA)
        # the max of the raw scores, scaled once per row (the scale is > 0: the same m as scaling
        # every score first), then qk * scale - m as one FMA per score: one FMUL less per score,
        # 2-5% of the forward on an H200 (docs/benchmarks.md)
        s = _mm(q, tl.trans(k), PREC)
        if DIAG:
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        if not EVEN:
            s = tl.where(cols[None, :] < S, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = exp2_mixed(s * qk_scale - m_new[:, None], BM, BN, SOFT, DEG)  # AttnConfig.exp_soft
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["NB", "BH", "G"])  # one compile for any launch order
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                H, REP, L, S, qk_scale, NB, BH, G,
                CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                PREC: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, I64: tl.constexpr,
                SOFT: tl.constexpr = 0, DEG: tl.constexpr = 3):
    # TMA: Q, K, V, O are [B, H(k), L/S, D] descriptors - the same products in the same order as
    # pointer loads (the same bits), 9% faster at head_dim 128 on an H200 (docs/benchmarks.md)
    pid_m, bh = _block_and_head(NB, BH, G)
    b = bh // H
    h = bh % H
    hk = h // REP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    if TMA:
        q_src = Q
        k_src = K
        v_src = V
    else:
        q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_src = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    q = _tile(q_src, b, h, m0, offs_m, sqm, offs_d, L, BM, D, EVEN, I64, TMA)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        # blocks left of the diagonal need no mask; BM is a multiple of BN
        diag = tl.minimum(m0, S)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, 0, diag, S,
                                   qk_scale, False, EVEN, BN, D, PREC, TMA, I64, BM, SOFT, DEG)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, diag,
                                   tl.minimum(m0 + BM, S), S, qk_scale, True, EVEN, BN, D, PREC, TMA, I64, BM, SOFT,
                                   DEG)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, skn, svn, offs_m, 0, S, S,
                                   qk_scale, False, EVEN, BN, D, PREC, TMA, I64, BM, SOFT, DEG)
    acc = (acc / l_i[:, None]).to(q.dtype)
    lse_ptr = LSE + bh.to(tl.int64) * L + offs_m
    if TMA:
        O.store([b, h, m0, 0], tl.reshape(acc, [1, 1, BM, D]))  # rows past L are not written
    else:
        o_ptr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :]
        if EVEN:
            tl.store(o_ptr, acc)
        else:
            tl.store(o_ptr, acc, mask=offs_m[:, None] < L)
    if EVEN:
        tl.store(lse_ptr, m_i + tl.math.log2(l_i))
    else:
        tl.store(lse_ptr, m_i + tl.math.log2(l_i), mask=offs_m < L)


def _prec(t: torch.Tensor) -> str:
    if t.device.type == "cpu" and t.dtype != torch.float32:
        return "up"  # the interpreter
    return "ieee" if t.dtype == torch.float32 else "tf32"  # tf32 is unused for 16-bit dots


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q, k, v, causal: bool, scale: float, cfg: AttnConfig | None = None):
    """q [B, H, L, D], k/v [B, Hk, S, D] -> (o [B, H, L, D] contiguous, lse [B*H, L] fp32, log2)."""
    cfg = cfg or config_for(q.dtype, q.shape[-1])
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    o = torch.empty(B, H, L, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B * H, L, dtype=torch.float32, device=q.device)
    if S == 0:  # no keys: zeros, as torch's SDPA gives (the kernel would divide 0 by 0)
        return o.zero_(), lse.fill_(float("-inf"))
    nb = triton.cdiv(L, cfg.fwd_m)
    tma = cfg.fwd_tma and tma_ok(q, k, v)
    args = ((desc(q, cfg.fwd_m), desc(k, cfg.fwd_n), desc(v, cfg.fwd_n), desc(o, cfg.fwd_m)) if tma
            else (q, k, v, o))
    _fwd_kernel[(nb * B * H,)](*args, lse, q.stride(0), q.stride(1), q.stride(2),
                               k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                               o.stride(0), o.stride(1), o.stride(2), H, H // Hk, L, S, scale * LOG2E,
                               nb, B * H, min(cfg.fwd_group, B * H),
                               CAUSAL=causal, BM=cfg.fwd_m, BN=cfg.fwd_n, D=D, PREC=_prec(q),
                               EVEN=L % cfg.fwd_m == 0 and S % cfg.fwd_n == 0, TMA=tma, I64=wide(q, k, v),
                               SOFT=cfg.soft(4), DEG=cfg.exp_soft_deg,
                               num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, lse


@functools.cache
def host_tma() -> bool:
    """Host-side TMA descriptors (triton.tools.tensor_descriptor: newer Triton than the oldest
    this package admits); without them the kernels load and store by pointers (the same bits)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def tma_ok(*ts: torch.Tensor) -> bool:
    """TMA descriptors over these tensors: Triton has host descriptors, the chip is a Hopper or
    later (the interpreter takes them on the CPU), bases and strides 16-byte aligned, unit last
    stride, and no tensor empty."""
    if not host_tma() or any(t.numel() == 0 for t in ts):
        return False
    if ts[0].is_cuda and torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    # a broadcast (stride 0) dimension goes by pointers: CUDA asks only for strides that are
    # multiples of 16 bytes, but no stride-0 descriptor has run on a GPU here
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(st > 0 and st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in ts)


def wide(*ts: torch.Tensor) -> bool:
    """Whether a row offset (row * row stride, rows up to a tile past the end) of these [..., R, D]
    tensors can pass int32: the kernels then take int64 row offsets (I64; the same bits)."""
    return any((t.shape[-2] + 256) * t.stride(-2) >= 2**31 for t in ts)


def desc(t: torch.Tensor, rows: int, cols: int | None = None):
    """A TMA descriptor over t [..., R, C] whose block is `rows` x `cols` (whole rows by default) of
    one leading index."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1] * (t.dim() - 2) + [rows, cols or t.shape[-1]])


# every process keys these kernels alike, whichever it launches first (kernels/jit_keys.py)
from tpdiag.kernels.jit_keys import settle as _settle_keys  # noqa: E402

_settle_keys(globals())
