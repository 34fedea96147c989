"""Triton kernel for the per-group sums of the TP-invariant vocab softmax (`invariant-vocab-softmax`).

For logits [T, V_local] cut into G_local groups of S = V_local / G_local adjacent columns and
the (exact, all-reduced) row max m [T], computes in fp32

    s[g, t] = sum over the columns v of group g of exp(logits[t, v] - m[t])      -> [G_local, T]

Why the bits of s[g, t] are the same at every TP degree and every T: one program owns one
(row, group) pair and walks the group from its first column in BLOCK-wide steps; lane i of an
fp32 accumulator takes columns i, i + BLOCK, i + 2 BLOCK, ... in that order, and the BLOCK lanes
are then reduced by one tl.sum. S and BLOCK (a function of S alone) are compile-time constants;
what varies with T or with the TP degree (rows, groups per rank) is a runtime argument Triton is
told not to specialise on, and the base pointer is always 16-byte aligned (else copied). So a
(row, group) pair runs the same compiled instructions on the same values whatever else is in the
call. The tree over the groups (kernels/tree.py) is unchanged.

Also here: `triton_path`, the dispatch rule shared by the tree fixes' kernels, and the lazy
import (`import tpdiag` never imports Triton). `TPDIAG_TRITON_CPU=1` routes CPU tensors through
the Triton interpreter, as for invariant-gemm.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

# Bound by _triton(): the kernel resolves ``tl`` from this module's globals when it is compiled.
triton = None
tl = None


# --------------------------------------------------------------------------------------
# Triton kernel (wrapped with triton.jit by _triton())
# --------------------------------------------------------------------------------------
def _group_exp_sum_kernel(x_ptr, m_ptr, out_ptr, n_rows, n_groups,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Program pid -> (row, group); x is [n_rows, n_groups * GROUP] row-major, out [n_groups, n_rows]."""
    pid = tl.program_id(0).to(tl.int64)  # int64: T * V_local can pass 2**31
    row = pid // n_groups
    grp = pid % n_groups
    # GROUP is a constant, so the group's start keeps the same alignment (vector width of the
    # loads, hence the same compiled code) for every n_groups, i.e. at every TP degree.
    base = x_ptr + (row * n_groups + grp) * GROUP
    m = tl.load(m_ptr + row)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, GROUP, BLOCK):
        idx = k + offs
        inside = idx < GROUP
        x = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32)
        # Past the group's end: an exact 0 (adding +0.0 to a sum of non-negatives changes nothing).
        acc += tl.where(inside, tl.exp(x - m), 0.0)
    tl.store(out_ptr + grp * n_rows + row, tl.sum(acc, axis=0))


_JIT_FUNCTIONS = ("_group_exp_sum_kernel",)


@functools.lru_cache(maxsize=None)
def _triton():
    """Import Triton (through gemm_common's importer: same TPDIAG_TRITON_CPU handling) and
    wrap the kernel. Rows and groups per call are never specialised (value 1, divisibility):
    the compiled kernel is the same for every T and every TP degree."""
    global triton, tl
    from tpdiag.kernels.gemm_common import import_triton as _import_triton

    triton = _import_triton()
    tl = triton.language
    g = globals()
    for name in _JIT_FUNCTIONS:
        fn = getattr(g[name], "fn", g[name])
        g[name] = triton.jit(fn, do_not_specialize=["n_rows", "n_groups"])
    return triton


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] = None
        return False


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_path(t: torch.Tensor) -> bool:
    """The tree fixes' dispatch: the Triton kernels for CUDA tensors when Triton is importable,
    and for CPU tensors under the interpreter when TPDIAG_TRITON_CPU=1; the torch path otherwise.
    Depends on the device and environment only, so every TP degree takes the same path."""
    if t.dtype not in _DTYPES:
        return False
    if t.device.type == "cuda":
        return _have_triton()
    return t.device.type == "cpu" and os.environ.get("TPDIAG_TRITON_CPU") == "1"


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned base: Triton specialises on the pointer's alignment, and
    a differently aligned shard would compile (and could vectorise and sum) differently. A copy
    moves bits only."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = torch.empty_like(t).copy_(t)  # a fresh allocation: aligned
    return t


# --------------------------------------------------------------------------------------
# Fixed blocking: a function of the group size only (never of T, V_local or the rank)
# --------------------------------------------------------------------------------------
# 2048 = 8 warps x 32 lanes x 8 elements: one 16-byte load per lane and step for bf16. Any fixed
# value is invariant; changing it changes the bits (another order), so it must not vary per run.
MAX_BLOCK = 2048


def block_for(group: int) -> int:
    return min(MAX_BLOCK, next_pow2(group))


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


# --------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------
def group_exp_sums(logits: torch.Tensor, m: torch.Tensor, groups: int, *,
                   block: int | None = None) -> torch.Tensor:
    """logits [T, V_local] (fp32/bf16/fp16), m [T] -> fp32 [groups, T]: the sum of exp(l - m)
    over each of `groups` equal column groups. `block` overrides the fixed blocking (tests):
    a different block is a different summation order, hence (usually) different bits."""
    if logits.dim() != 2:
        raise ValueError(f"group_exp_sums: expected logits [T, V], got {tuple(logits.shape)}")
    t, v = logits.shape
    if groups < 1 or v % groups:
        raise ValueError(f"group_exp_sums: {v} columns do not split into {groups} groups")
    if logits.dtype not in _DTYPES:
        raise TypeError(f"group_exp_sums: dtype {logits.dtype} not supported")
    if m.shape != (t,):
        raise ValueError(f"group_exp_sums: m must be [T] = [{t}], got {tuple(m.shape)}")
    s = v // groups
    blk = block or block_for(s)
    out = torch.empty((groups, t), dtype=torch.float32, device=logits.device)
    if t == 0:
        return out
    if s == 0:
        return out.zero_()
    _triton()
    x = aligned(logits)
    mm = aligned(m.float())
    _group_exp_sum_kernel[(t * groups,)](x, mm, out, t, groups, GROUP=s, BLOCK=blk,
                                         num_warps=_num_warps(blk))
    return out


# --------------------------------------------------------------------------------------
# float64 reference
# --------------------------------------------------------------------------------------
def reference_group_exp_sums(logits: torch.Tensor, m: torch.Tensor, groups: int) -> torch.Tensor:
    """What group_exp_sums approximates, in float64: [groups, T]."""
    t, v = logits.shape
    e = torch.exp(logits.double() - m.double()[:, None])
    return e.reshape(t, groups, v // groups).sum(-1).t()
