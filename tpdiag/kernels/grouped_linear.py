"""TP-invariant linear layers: one reduction order and one GEMM shape per group at every TP.

Row-parallel (weight [N, K] split on K): each rank computes fp32 partial products for its K
groups, reduces them as a subtree and the tree is finished across ranks (kernels/tree.py).
Rounding happens once, after the whole sum - a bf16 partial rounded before an all-reduce can
never match TP=1. Backward GEMMs reduce over N or tokens, not K: per K group on CPU, one
invariant Triton GEMM per rank on CUDA (its bits per output column do not depend on the shard).

Column-parallel (weight split on N): forward and wgrad with shape-invariant bits
(`invariant-gemm`: one call of the invariant Triton GEMM on CUDA, fixed N blocks of one shape on
CPU, each in fixed row blocks: kernels/row_blocks.py), dgrad dX = sum_n dY[:, n] W[n, :] as an
N-group tree across ranks (`tp-invariant-linear`). On the CPU every group GEMM runs in fixed row
blocks, so a token's bits do not depend on the rows per call (micro-batches, decode steps).

Both take LOCAL shards and the group range this rank owns; TP=1 is the same code with all
groups local, so TP=1 itself follows the canonical order when a fix is on.

16-bit group GEMMs on the Triton path (`_tree_partial`): when the run's largest degree holds one
group per rank (G = that degree, tree.gemm_per_group()), every group at every degree is one
invariant GEMM call with fp32 output - at the largest degree that is the rank's whole product,
no in-rank tree - and a rank with several groups adds their results in the tree's pairing.
Otherwise a rank's groups run fused in tree_mm (tree_gemm.py). Either is TP-invariant; they are
other bits from each other, so a run uses one.
"""
from __future__ import annotations

import torch

from tpdiag.kernels import carry_ops, tree_overlap
from tpdiag.kernels.grad_carry import live
from tpdiag.kernels.shaped import shaped
from tpdiag.kernels.tree import TreeAllReduce, gemm_per_group, tree_all_reduce, tree_sum
from tpdiag.kernels.vocab_ce_triton import triton_path


def _fp32_config(a):
    """The Triton config of _mm's fp32 group GEMMs (see there): fixed per call site."""
    from tpdiag.kernels.invariant_gemm_config import IEEE_FP32_CONFIG

    return IEEE_FP32_CONFIG if a.is_cuda and a.dtype == torch.float32 else None


def _carry_wgrad(site, w, g2, x2, groups: int, dim: int, triton: bool, config=None) -> None:
    """Grad accumulation's wgrad (kernels/grad_carry.py): site's fp32 carry [N, K] += g2^T @ x2
    over the tokens in fixed blocks. triton: one call over the local shard (the invariant GEMM's
    bits per output element do not depend on the shard); else per fixed group along `dim` (0: N,
    1: K) - the same block shapes at every TP."""
    carry = site.zeros(w.shape, w.device)
    site.walk(g2.shape[0], carry_ops.gemm_block(triton, g2.device, x2.dtype, config))
    if triton:
        carry_ops.add_mm(carry, g2, x2, triton=True, config=config)
        return
    gs = g2.chunk(groups, -1) if dim == 0 else [g2] * groups
    xs = x2.chunk(groups, -1) if dim == 1 else [x2] * groups
    for c, gg, xg in zip(carry.chunk(groups, dim), gs, xs):
        carry_ops.add_mm(c, gg, xg)


def _mm(a, b):
    """One tp-invariant-linear group GEMM. Its shape is the same at every TP, so cuBLAS / CPU BLAS
    already give the same bits; on CUDA (or TPDIAG_TRITON_CPU=1) it runs invariant-gemm's Triton
    kernel instead, whose bits do not depend on the shape at all (fixed tiles per dtype, K walked
    in order, no split-K): the same bits at every TP, whatever cuBLAS's heuristics pick."""
    if triton_path(a) and a.dtype == b.dtype:
        from tpdiag.kernels.invariant_gemm import triton_mm

        # fp32 groups: the IEEE FMA tile, not Hopper's pre-split bf16x6 default. These GEMMs
        # are small (tokens x one group) and many; the split's extra passes per call cost more
        # than the tensor cores save: llama-1b bf16 fix step at TP=2 on 2x H200, +74-88% with
        # bf16x6 vs +33% with this tile. Fixed per call site, so the same bits at every TP.
        out = triton_mm(a.reshape(-1, a.shape[-1]), b, config=_fp32_config(a))
        return shaped(out, *a.shape[:-1], b.shape[-1])
    return _rows_mm(a, b)


def _rows_mm(a, b):
    """Off the Triton path: BLAS in fixed row blocks (kernels/row_blocks.py), so a token's bits
    do not depend on how many tokens share the call (a micro-batch, a decode step's one row per
    sequence); CPU only - a CUDA tensor here (16-bit group GEMMs are Triton's) keeps cuBLAS."""
    if a.device.type != "cpu":
        return torch.matmul(a, b)
    from tpdiag.kernels.row_blocks import row_blocked_mm

    return row_blocked_mm(a, b)


def _tree_partial(a: torch.Tensor, b: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 [M, N]: the subtree root over `groups` equal K ranges of a [M, K] @ b [K, N]
    (16-bit operands on the Triton path; their products are exact in fp32)."""
    if gemm_per_group():
        from tpdiag.kernels.invariant_gemm import triton_mm

        # one call per group: the invariant GEMM's bits depend on K (the group's length, the same
        # at every TP) and not on M, N, strides or where the slice starts, so group g is the same
        # call at every degree; one group per rank is one plain GEMM, no fp32 per-group tensors
        kg = a.shape[1] // groups
        return tree_sum([triton_mm(a[:, g * kg:(g + 1) * kg], b[g * kg:(g + 1) * kg],
                                   out_dtype=torch.float32) for g in range(groups)])
    from tpdiag.kernels.tree_gemm import tree_mm

    return tree_mm(a, b, groups)


class RowLinearPartial(torch.autograd.Function):
    """x_local [..., K_r], w_local [N, K_r] -> fp32 subtree root [..., N] over `groups` K groups."""

    @staticmethod
    def forward(ctx, x, w, groups: int, site=None):
        ctx.save_for_backward(x, w)
        ctx.groups = groups
        ctx.site = site  # grad accumulation's carry for w (None: w's grad returned as usual)
        return shaped(_row_partial(x.reshape(-1, x.shape[-1]), w, groups), *x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        groups = ctx.groups
        dx = dw = None
        if _tensor_cores(x, w):
            # Neither backward GEMM reduces over K (dgrad reduces over N, wgrad over tokens):
            # the K groups are only output columns, and invariant-gemm's bits per column do not
            # depend on how many columns one call computes, so one call per rank gives the
            # group GEMMs' bits at any TP. 16-bit operands, fp32 accumulation, one rounding -
            # instead of upcasting to fp32 FMA GEMMs (the fix step's largest cost on an H200).
            # g is the fp32 upcast of the 16-bit grad of y.to(x.dtype) (row_parallel_linear),
            # so casting it back is exact.
            from tpdiag.kernels.invariant_gemm import triton_mm

            g16 = g.to(x.dtype).reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = triton_mm(g16, w).reshape(*x.shape)
            if ctx.needs_input_grad[1]:
                if live(ctx.site):  # the same call, continued from the carry (fp32, no rounding)
                    _carry_wgrad(ctx.site, w, g16, x.reshape(-1, x.shape[-1]), groups, 1, True)
                else:
                    dw = triton_mm(g16.t(), x.reshape(-1, x.shape[-1])).to(w.dtype)
            return dx, dw, None, None
        g = g.float().contiguous()
        ws = w.float().chunk(groups, dim=-1)
        xs = x.float().chunk(groups, dim=-1)
        if ctx.needs_input_grad[0]:
            dx = torch.cat([_mm(g, wg.contiguous()) for wg in ws], dim=-1).to(x.dtype)
        if ctx.needs_input_grad[1] and live(ctx.site):
            x2 = x.reshape(-1, x.shape[-1])
            tri = triton_path(x2) and x2.dtype == w.dtype
            # fp32 operands here (the 16-bit Triton case returned above); the CPU path: per K group
            _carry_wgrad(ctx.site, w, g.reshape(-1, g.shape[-1]), x2.float() if not tri else x2,
                         groups, 1, tri, _fp32_config(x2) if tri else None)
        elif ctx.needs_input_grad[1]:
            g2 = g.reshape(-1, g.shape[-1]).t().contiguous()
            dw = torch.cat([_mm(g2, xg.reshape(-1, xg.shape[-1]).contiguous()) for xg in xs],
                           dim=-1).to(w.dtype)
        return dx, dw, None, None


def _row_partial(x2, w, groups: int) -> torch.Tensor:
    """x2 [rows, K_r], w [N, K_r] -> fp32 subtree root [rows, N]; a row's bits do not depend on
    the rows per call."""
    if _tensor_cores(x2, w):
        # 16-bit operands on tensor cores: their products are exact in fp32 and every group
        # is summed in fp32 - the same as upcasting first, in another fixed order - and the
        # rank's groups give one fp32 subtree root (_tree_partial: one invariant GEMM per
        # group, or the groups' tree finished in registers by tree_mm)
        return _tree_partial(x2, w.t(), groups)
    xs = x2.float().chunk(groups, dim=-1)
    ws = w.float().chunk(groups, dim=-1)
    return tree_sum([_mm(xg.contiguous(), wg.t().contiguous()) for xg, wg in zip(xs, ws)])


def row_reduced(ctx, x, w, groups: int, site=None) -> torch.Tensor:
    """RowLinearPartial's forward then TreeAllReduce's to x's dtype, on one ctx (the DTensor
    Function's); with the collective under the GEMM in row chunks where tree_overlap allows it."""
    rows = x.numel() // x.shape[-1]
    if not tree_overlap.usable(rows):
        return TreeAllReduce.forward(ctx, RowLinearPartial.forward(ctx, x, w, groups, site), x.dtype)
    ctx.save_for_backward(x, w)
    ctx.groups, ctx.site, ctx.part_dtype = groups, site, torch.float32
    x2 = x.reshape(-1, x.shape[-1])
    y = tree_overlap.reduce_in_chunks(lambda r0, r1: _row_partial(x2[r0:r1], w, groups), rows,
                                      w.shape[0], x.dtype, x.device)
    return shaped(y, *x.shape[:-1], w.shape[0])


def _tensor_cores(x, w) -> bool:
    """16-bit operands on the Triton path: their products are exact in fp32."""
    return triton_path(x) and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype


def row_parallel_linear(x, w, bias, local_groups: int, site=None):
    """Whole output, replicated on every rank, identical at every TP."""
    y = tree_all_reduce(RowLinearPartial.apply(x, w, local_groups, site), x.dtype)
    return y + bias if bias is not None else y


class ColLinear(torch.autograd.Function):
    """x [..., K] replicated, w_local [N_r, K] -> y_local [..., N_r].

    blocked: forward/wgrad with shape-invariant bits (invariant Triton GEMM, or `local_groups`
    fixed N blocks off the Triton path).
    tree_dgrad: dX as a tree over N groups finished across ranks (replaces the all-reduce).
    """

    @staticmethod
    def forward(ctx, x, w, local_groups: int, blocked: bool, tree_dgrad: bool, site=None):
        ctx.save_for_backward(x, w)
        ctx.cfg = (local_groups, blocked, tree_dgrad)
        ctx.site = site  # grad accumulation's carry for w (blocked only)
        if blocked and triton_path(x) and x.dtype == w.dtype:
            # invariant-gemm's kernel: its bits per output column do not depend on how many
            # columns one call computes, so one call over the local shard gives the fixed
            # blocks' bits at every TP - one launch, no weight copies, no concatenation.
            from tpdiag.kernels.invariant_gemm import triton_mm

            return shaped(triton_mm(x.reshape(-1, x.shape[-1]), w.t()), *x.shape[:-1], w.shape[0])
        if blocked:
            # off the Triton path: fixed N blocks, the same GEMM shape at every TP (CPU BLAS /
            # cuBLAS choose by shape, so equal shapes give equal bits)
            # (and on the CPU fixed row blocks: the same bits for a token in any number of rows)
            return torch.cat([_rows_mm(x, wg.t().contiguous()) for wg in w.chunk(local_groups, 0)],
                             dim=-1)
        return torch.matmul(x, w.t())  # stock (unblocked) GEMM: what invariant-gemm replaces

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        local_groups, blocked, tree_dgrad = ctx.cfg
        g = g.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if tree_dgrad:
                g2 = g.reshape(-1, g.shape[-1])
                if tree_overlap.usable(g2.shape[0]):
                    dx = tree_overlap.reduce_in_chunks(
                        lambda r0, r1: _dgrad_partial(g2[r0:r1], w, local_groups), g2.shape[0],
                        w.shape[1], x.dtype, g.device)
                else:
                    dx = tree_all_reduce(_dgrad_partial(g2, w, local_groups), x.dtype)
                dx = dx.reshape(*g.shape[:-1], w.shape[1])
            else:
                dx = _all_reduce_sum(torch.matmul(g, w))  # stock dgrad
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            g2 = g.reshape(-1, g.shape[-1])
            if blocked and live(ctx.site):
                # one Triton call continued from the carry, or per fixed N group in token blocks
                _carry_wgrad(ctx.site, w, g2, x2, local_groups, 0, triton_path(x) and x.dtype == w.dtype)
            elif blocked and triton_path(x) and x.dtype == w.dtype:
                from tpdiag.kernels.invariant_gemm import triton_mm

                dw = triton_mm(g2.t(), x2)  # output rows: the same bits at any shard height
            elif blocked:
                dw = torch.cat([torch.matmul(gg.t().contiguous(), x2)
                                for gg in g2.chunk(local_groups, -1)], 0)
            else:
                dw = torch.matmul(g2.t(), x2)  # stock wgrad
        return dx, dw, None, None, None, None


def _dgrad_partial(g2, w, local_groups: int) -> torch.Tensor:
    """g2 [rows, N_r], w [N_r, K] -> fp32 subtree root [rows, K] over this rank's N groups (on
    tensor cores: 16-bit products, fp32 sums); a row's bits do not depend on the rows per call."""
    if _tensor_cores(g2, w):
        return _tree_partial(g2, w, local_groups)
    gs = g2.float().chunk(local_groups, dim=-1)
    ws = w.float().chunk(local_groups, dim=0)
    return tree_sum([_mm(gg.contiguous(), wg.contiguous()) for gg, wg in zip(gs, ws)])


def _all_reduce_sum(t):
    """The stock dgrad reduction (what the fix replaces), for the blocked-only configuration."""
    from tpdiag.kernels.tree import world_size

    if world_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


class ColBias(torch.autograd.Function):
    """y_local + bias_local. Backward: the bias grad (a sum over tokens) per fixed N group of one
    contiguous shape, so its bits do not depend on how many columns the rank holds (a plain
    `y + bias` sums [tokens, N/TP] at once: on CPU another vectorisation at another width)."""

    @staticmethod
    def forward(ctx, y, bias, local_groups: int, site=None):
        ctx.local_groups = local_groups
        ctx.site = site
        return y + bias

    @staticmethod
    def backward(ctx, g):
        g2 = g.reshape(-1, g.shape[-1])
        if live(ctx.site):  # grad accumulation: per fixed N group, token blocks into the carry
            carry = ctx.site.zeros((g2.shape[-1],), g2.device)
            ctx.site.walk(g2.shape[0], carry_ops.torch_block(g2.device))
            for c, gg in zip(carry.chunk(ctx.local_groups), g2.chunk(ctx.local_groups, -1)):
                carry_ops.add_colsum(c, gg)
            return g, None, None, None
        db = torch.cat([gg.contiguous().sum(0) for gg in g2.chunk(ctx.local_groups, -1)])
        return g, db, None, None


def col_parallel_linear(x, w, bias, local_groups: int, blocked: bool, tree_dgrad: bool,
                        sites=(None, None)):
    """sites: grad accumulation's carry sites of (w, bias) (kernels/grad_carry.py), or None."""
    y = ColLinear.apply(x, w, local_groups, blocked, tree_dgrad, sites[0])
    return ColBias.apply(y, bias, local_groups, sites[1]) if bias is not None else y


def reference_linear(x, w, bias=None):
    """float64 reference."""
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y
