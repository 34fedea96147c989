"""G = the run's largest degree, on the GPU path (Triton interpreter, tiny bf16 shapes): the rank
that holds ONE group computes its row-parallel forward / column-parallel dgrad with one
invariant GEMM (fp32 out) - no tree_mm - and TP=1 with G groups, each group one such call, then
the same tree, gives the same bits; a degree in between (2 groups per rank) too.
Negative controls: one call over the whole K, the groups added in another order, and the fused
tree_mm family (what a G above every degree runs) are other bits - so the bitwise checks can
fail, and one run must not mix the two families.

One subprocess (TRITON_INTERPRET=1 must be set before triton is imported) prints a JSON of
results; the tests assert on it.
"""
from __future__ import annotations

import textwrap

import pytest

from conftest import ROOT, interpreter_result


_SCRIPT = textwrap.dedent("""
    import dataclasses, json
    import torch
    from tpdiag.kernels import grouped_linear as gl, invariant_gemm as ig, tree, tree_gemm

    calls = {"mm": 0, "tree_mm": 0}
    def counting(mod, name, key):
        f = getattr(mod, name)
        def wrapped(*a, **k):
            calls[key] += 1
            return f(*a, **k)
        setattr(mod, name, wrapped)
    counting(ig, "triton_mm", "mm")
    counting(tree_gemm, "tree_mm", "tree_mm")

    def same(x, y):
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
            x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))

    def counted(fn):
        before = dict(calls)
        out = fn()
        return out, {k: calls[k] - before[k] for k in calls}

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    M, N, KG = 20, 24, 48        # M, N not tile multiples; a group of 48 = a masked K tail
    res = {}
    for G in (2, 4):
        K = G * KG
        x = (torch.randn(M, K, generator=gen) * 4).to(bf)
        w = torch.randn(N, K, generator=gen).to(bf)        # row-parallel weight [N, K]
        dy = torch.randn(M, K, generator=gen).to(bf)       # column dgrad: dy [M, Nc] @ wc [Nc, Kc]
        wc = torch.randn(K, N, generator=gen).to(bf)
        with tree.install_tree_groups(G, per_group=True):
            assert tree.n_groups() == G and tree.gemm_per_group()
            # TP=1: every group is one call on its slice, the groups added in the tree
            ref, c1 = counted(lambda: gl.RowLinearPartial.apply(x, w, G))
            res[f"G{G} tp1 calls"] = c1
            dref = gl._tree_partial(dy, wc, G)
            for tp in (G, G // 2) if G > 2 else (G,):
                lg = G // tp
                # each rank holds its contiguous shard, as after parallelize_module
                xs = [c.contiguous() for c in x.chunk(tp, -1)]
                ws = [c.contiguous() for c in w.chunk(tp, -1)]
                roots, cr = counted(lambda: [gl.RowLinearPartial.apply(a, b, lg) for a, b in zip(xs, ws)])
                res[f"G{G} tp{tp} row"] = same(tree.tree_sum_stacked(torch.stack(roots)), ref)
                res[f"G{G} tp{tp} calls"] = cr
                dys = [c.contiguous() for c in dy.chunk(tp, -1)]
                wcs = [c.contiguous() for c in wc.chunk(tp, 0)]
                droots = [gl._tree_partial(a, b, lg) for a, b in zip(dys, wcs)]
                res[f"G{G} tp{tp} dgrad"] = same(tree.tree_sum_stacked(torch.stack(droots)), dref)
                if lg == 1:
                    # one group per rank: the rank's partial IS one plain invariant GEMM
                    res[f"G{G} tp{tp} plain"] = all(
                        same(r, ig.triton_mm(a, b.t(), out_dtype=torch.float32)) for r, a, b in zip(roots, xs, ws))
                    # ColLinear's tree dgrad at one group per rank: triton_mm, no tree_mm
                    xr = torch.randn(M, N, generator=gen).to(bf).requires_grad_(True)
                    y = gl.ColLinear.apply(xr, wcs[0], 1, False, True)  # w_local [Nc/tp, N]
                    _, cc = counted(lambda: torch.autograd.grad(y, xr, dys[0]))
                    res[f"G{G} tp{tp} col calls"] = cc
            # negative controls
            res[f"G{G} whole K differs"] = not same(ig.triton_mm(x, w.t(), out_dtype=torch.float32), ref)
            parts = [ig.triton_mm(x[:, g * KG:(g + 1) * KG], w.t()[g * KG:(g + 1) * KG], out_dtype=torch.float32)
                     for g in range(G)]
            res[f"G{G} parts tree"] = same(tree.tree_sum(parts), ref)
            chain = parts[0]
            for p in parts[1:]:
                chain = chain + p
            res[f"G{G} chain differs"] = not same(chain, ref)
        res[f"G{G} fused differs"] = not same(tree_gemm.tree_mm(x, w.t(), G), ref)
        # no run setting: the fused family, as before
        _, cf = counted(lambda: gl.RowLinearPartial.apply(x, w, G))
        res[f"G{G} default calls"] = cf
    # what the GPU runs for bf16 (Hopper): the TMA kernel - a group's slice of the whole K at
    # TP=1 and the rank's contiguous shard give the same fp32 bits there too
    tma = dataclasses.replace(ig.INTERPRETER_CONFIGS[bf], tma=True)
    K = 2 * KG
    x = torch.randn(M, K, generator=gen).to(bf)
    w = torch.randn(N, K, generator=gen).to(bf)
    res["tma slice == shard"] = all(
        same(ig.triton_mm(x[:, g * KG:(g + 1) * KG], w.t()[g * KG:(g + 1) * KG], out_dtype=torch.float32, config=tma),
             ig.triton_mm(x[:, g * KG:(g + 1) * KG].contiguous(), w[:, g * KG:(g + 1) * KG].contiguous().t(),
                          out_dtype=torch.float32, config=tma)) for g in range(2))
    print("RESULT " + json.dumps(res))
""")


@pytest.fixture(scope="module")
def res():
    return interpreter_result(_SCRIPT, unset=("TPDIAG_TREE_GROUPS",), cwd=ROOT)


@pytest.mark.parametrize("G", [2, 4])
def test_one_group_per_rank_is_one_invariant_gemm(res, G):
    # the largest degree (TP=G): one triton_mm per rank, tree_mm never called; its partial is
    # exactly the plain GEMM's fp32 output
    assert res[f"G{G} tp{G} calls"] == {"mm": G, "tree_mm": 0}, res[f"G{G} tp{G} calls"]
    assert res[f"G{G} tp{G} plain"]
    assert res[f"G{G} tp{G} col calls"] == {"mm": 1, "tree_mm": 0}, res[f"G{G} tp{G} col calls"]
    # TP=1 computes each of its G groups with that same call
    assert res[f"G{G} tp1 calls"] == {"mm": G, "tree_mm": 0}


@pytest.mark.parametrize("G,tp", [(2, 2), (4, 4), (4, 2)])
def test_rank_roots_finish_the_tp1_tree_bitwise(res, G, tp):
    assert res[f"G{G} tp{tp} row"], "row-parallel forward: the ranks' tree != TP=1"
    assert res[f"G{G} tp{tp} dgrad"], "column-parallel dgrad: the ranks' tree != TP=1"
    assert res[f"G{G} parts tree"]


@pytest.mark.parametrize("G", [2, 4])
def test_negative_controls_differ(res, G):
    assert res[f"G{G} whole K differs"], "one GEMM over the whole K gave the tree's bits"
    assert res[f"G{G} fused differs"], "tree_mm gave the per-group calls' bits"
    if G == 4:  # with two groups an add is commutative: only from three on does order show
        assert res[f"G{G} chain differs"], "a left-to-right chain gave the tree's bits"


@pytest.mark.parametrize("G", [2, 4])
def test_without_a_run_setting_the_fused_kernel_runs(res, G):
    assert res[f"G{G} default calls"] == {"mm": 0, "tree_mm": 1}


def test_tma_kernel_group_slice_is_the_rank_shard(res):
    assert res["tma slice == shard"]
