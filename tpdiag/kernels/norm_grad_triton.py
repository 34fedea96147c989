"""Triton kernels for the TP-invariant RMSNorm (`invariant-norm-grad`, kernels/norm_grad.py).

* Per-group column sums of dgamma: for x [..., D] sharded on `group_dim` and cut into G_local
  groups along it, s[g, d] = sum over every element of group g of g_out.float() * y.float()
  -> [G_local, D] fp32 (each group is one subtree leaf of kernels/tree.py).
* Per-row means over the hidden dim: mean(a * b) (the backward's dot) and rsqrt(mean(x^2) + eps)
  (the forward's rstd) -> [..., 1] fp32.

Why the bits do not depend on the TP degree or on T: a group's rows are enumerated in one
global order (outer index, then position inside the group) that is the same at every TP; they
are cut into chunks of CHUNK rows, each chunk summed by one program over BLOCK_R-row tiles into
an fp32 [BLOCK_R, BLOCK_D] accumulator and reduced by one tl.sum, and the chunk partials are
added in chunk order by a second kernel. BLOCK_R, BLOCK_D and CHUNK are functions of the
group's shape (rows per group, D) alone. A row mean is one program's walk over D in BLOCK_D
steps, the same for every row whatever else is in the call, so the rstd no longer needs the
per-group calls of the torch path. What varies with TP or T (outer size, groups per rank, row
count) is a runtime argument Triton does not specialise on; bases are 16-byte aligned.
"""
from __future__ import annotations

import functools

import torch

from tpdiag.kernels.vocab_ce_triton import aligned, next_pow2, triton_path  # noqa: F401 (shared dispatch)

__all__ = ["triton_path", "group_col_sums", "row_rstd", "row_dot_mean", "col_blocking", "row_blocking",
           "reference_group_col_sums", "reference_row_rstd", "reference_row_dot_mean"]

# Bound by _triton(): the kernels resolve ``tl`` from this module's globals when compiled.
triton = None
tl = None


# --------------------------------------------------------------------------------------
# Triton kernels (wrapped with triton.jit by _triton())
# --------------------------------------------------------------------------------------
def _group_col_partial_kernel(a_ptr, b_ptr, part_ptr, n_outer, n_groups, n_inner, n_chunks,
                              D: tl.constexpr, CHUNK: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (group * n_chunks + chunk, column block): partial column sums of a * b over one
    chunk of the group's rows. Row q of a group = (outer q // n_inner, inner q % n_inner); the
    tensors are [n_outer, n_groups, n_inner, D] row-major."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid // n_chunks
    chunk = pid % n_chunks
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    n_rows = n_outer * n_inner
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK_R):
        q = chunk * CHUNK + k + tl.arange(0, BLOCK_R).to(tl.int64)
        # D is a constant: every row starts at a multiple of D, at every TP (same vector loads).
        row = ((q // n_inner) * n_groups + grp) * n_inner + q % n_inner
        offs = row[:, None] * D + cols[None, :]
        ok = (q < n_rows)[:, None] & col_ok[None, :]
        # Masked rows/columns read 0: 0 * 0 adds an exact +0.0 to the accumulator.
        a = tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(part_ptr + pid * D + cols, tl.sum(acc, axis=0), mask=col_ok)


def _sum_chunks_kernel(part_ptr, out_ptr, n_chunks, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[g, d] = partial[g, 0, d] + partial[g, 1, d] + ..., left to right."""
    grp = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(0, n_chunks):
        acc += tl.load(part_ptr + (grp * n_chunks + c) * D + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + grp * D + cols, acc, mask=col_ok)


def _row_mean_kernel(a_ptr, b_ptr, out_ptr, n_rows, eps,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     SAME: tl.constexpr, RSQRT: tl.constexpr):
    """out[r] = mean_d(a[r, d] * b[r, d]) (b = a when SAME), or rsqrt(that + eps) when RSQRT."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    # Rows past the end read row 0 (a valid address) and are not stored: a row's tile
    # neighbours never enter its sum.
    rows = tl.where(row_ok, rows, 0)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for k in range(0, D, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        offs = rows[:, None] * D + cols[None, :]
        ok = (cols < D)[None, :]
        a = tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if SAME:
            b = a
        else:
            b = tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc += a * b
    s = tl.sum(acc, axis=1) / D
    if RSQRT:
        s = tl.rsqrt(s + eps)
    tl.store(out_ptr + rows, s, mask=row_ok)


_JIT = {
    "_group_col_partial_kernel": ["n_outer", "n_groups", "n_inner", "n_chunks"],
    "_sum_chunks_kernel": ["n_chunks"],
    "_row_mean_kernel": ["n_rows"],
}


@functools.lru_cache(maxsize=None)
def _triton():
    """Import Triton (gemm_common's importer: same TPDIAG_TRITON_CPU handling) and wrap the
    kernels; the sizes that vary with TP or T are never specialised (value 1, divisibility)."""
    global triton, tl
    from tpdiag.kernels.gemm_common import import_triton as _import_triton

    triton = _import_triton()
    tl = triton.language
    g = globals()
    for name, dynamic in _JIT.items():
        fn = getattr(g[name], "fn", g[name])
        g[name] = triton.jit(fn, do_not_specialize=dynamic)
    return triton


# --------------------------------------------------------------------------------------
# Fixed blocking: functions of the group's shape only
# --------------------------------------------------------------------------------------
COL_BLOCK_R = 64
COL_BLOCK_D = 64
MAX_CHUNKS = 32     # chunks per group: enough programs to fill a GPU at TP=8
ROW_TILE = 4096     # elements of one row-kernel tile


def col_blocking(rows_per_group: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, CHUNK) for a group of `rows_per_group` rows of width d."""
    chunk = max(COL_BLOCK_R, next_pow2(-(-rows_per_group // MAX_CHUNKS)))
    return COL_BLOCK_R, min(COL_BLOCK_D, next_pow2(d)), chunk


def row_blocking(d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) for rows of width d."""
    block_d = min(1024, next_pow2(d))
    return max(1, ROW_TILE // block_d), block_d


# --------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------
def _group_view(shape, groups: int, group_dim: int) -> tuple[int, int, int]:
    """(outer, inner, D) of x [..., D] viewed as [outer, groups, inner, D] along group_dim."""
    nd = len(shape)
    gd = group_dim % nd
    if nd < 2 or gd == nd - 1:
        raise ValueError(f"group_col_sums: group_dim {group_dim} must be a dim before the last "
                         f"of {tuple(shape)}")
    if groups < 1 or shape[gd] % groups:
        raise ValueError(f"group_col_sums: dim {gd} of {tuple(shape)} does not split into {groups} groups")
    outer = 1
    for s in shape[:gd]:
        outer *= s
    inner = shape[gd] // groups
    for s in shape[gd + 1:-1]:
        inner *= s
    return outer, inner, shape[-1]


def group_col_sums(a: torch.Tensor, b: torch.Tensor, groups: int, group_dim: int, *,
                   blocking: tuple[int, int, int] | None = None) -> torch.Tensor:
    """fp32 [groups, D]: row g = sum of a.float() * b.float() over every element of group g of
    `group_dim` (all dims but the last). `blocking` = (BLOCK_R, BLOCK_D, CHUNK) overrides the
    fixed one (tests); another blocking is another summation order."""
    if a.shape != b.shape:
        raise ValueError(f"group_col_sums: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    outer, inner, d = _group_view(a.shape, groups, group_dim)
    out = torch.empty((groups, d), dtype=torch.float32, device=a.device)
    rows = outer * inner
    if rows == 0 or d == 0:
        return out.zero_()
    block_r, block_d, chunk = blocking or col_blocking(rows, d)
    if chunk % block_r:
        raise ValueError(f"group_col_sums: CHUNK {chunk} is not a multiple of BLOCK_R {block_r}")
    n_chunks = -(-rows // chunk)
    _triton()
    part = torch.empty((groups, n_chunks, d), dtype=torch.float32, device=a.device)
    cols = -(-d // block_d)
    _group_col_partial_kernel[(groups * n_chunks, cols)](
        aligned(a), aligned(b), part, outer, groups, inner, n_chunks,
        D=d, CHUNK=chunk, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    _sum_chunks_kernel[(groups, cols)](part, out, n_chunks, D=d, BLOCK_D=block_d, num_warps=2)
    return out


def _row_mean(a, b, eps: float, rsqrt: bool, blocking) -> torch.Tensor:
    d = a.shape[-1]
    out = torch.empty(a.shape[:-1] + (1,), dtype=torch.float32, device=a.device)
    n = out.numel()
    if n == 0:
        return out
    block_r, block_d = blocking or row_blocking(d)
    _triton()
    x = aligned(a)
    y = x if b is None else aligned(b)
    _row_mean_kernel[(-(-n // block_r),)](x, y, out, n, float(eps), D=d, BLOCK_R=block_r, BLOCK_D=block_d,
                                          SAME=b is None, RSQRT=rsqrt, num_warps=4)
    return out


def row_rstd(x: torch.Tensor, eps: float, *, blocking: tuple[int, int] | None = None) -> torch.Tensor:
    """rsqrt(mean(x.float()**2, -1) + eps) -> fp32 [..., 1]."""
    return _row_mean(x, None, eps, True, blocking)


def row_dot_mean(a: torch.Tensor, b: torch.Tensor, *,
                 blocking: tuple[int, int] | None = None) -> torch.Tensor:
    """mean(a.float() * b.float(), -1) -> fp32 [..., 1]."""
    if a.shape != b.shape:
        raise ValueError(f"row_dot_mean: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return _row_mean(a, b, 0.0, False, blocking)


# --------------------------------------------------------------------------------------
# float64 references
# --------------------------------------------------------------------------------------
def reference_group_col_sums(a: torch.Tensor, b: torch.Tensor, groups: int, group_dim: int) -> torch.Tensor:
    t = a.double() * b.double()
    dims = tuple(range(t.dim() - 1))
    return torch.stack([c.sum(dim=dims) for c in t.chunk(groups, dim=group_dim)])


def reference_row_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)


def reference_row_dot_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double()).mean(-1, keepdim=True)
