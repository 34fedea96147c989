"""The tree fixes' Triton kernels under the Triton interpreter: accuracy against float64, and
the same bits for a group whether it is computed in a TP=1-sized call (all G groups) or in a
TP=2/4/8-sized call (the rank's G/TP groups), and for a row whatever else is in the call.

vocab_ce_triton.group_exp_sums (invariant-vocab-softmax), norm_grad_triton.group_col_sums /
row_rstd / row_dot_mean (invariant-norm-grad) and the tp-invariant-linear group GEMMs routed
through invariant_gemm.triton_mm run in ONE subprocess (TRITON_INTERPRET=1 must be set before
triton is imported) that prints a JSON of results; the tests assert on it. Negative controls:
a changed blocking changes the bits (so the bitwise checks can fail), and the stock torch
reductions (one sum over the whole local shard, ranks added in order) do differ across TP.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import interpreter_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TRITON = importlib.util.find_spec("triton") is not None
IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype]))


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


# --------------------------------------------------------------------------------------
# No Triton at import; the CPU default stays the torch path
# --------------------------------------------------------------------------------------
def test_imports_do_not_import_triton():
    code = textwrap.dedent("""
        import sys
        import tpdiag
        from tpdiag.kernels import vocab_ce_triton, norm_grad_triton, vocab_ce, norm_grad, grouped_linear
        import torch
        assert "triton" not in sys.modules, "importing the tree kernels imported triton"
        assert not vocab_ce_triton.triton_path(torch.zeros(2))   # CPU, no TPDIAG_TRITON_CPU
        sys.modules["triton"] = None
        vocab_ce_triton._have_triton.cache_clear()
        lo, lab = torch.randn(4, 64), torch.randint(0, 64, (4,))
        print(float(vocab_ce.token_logprobs(lo, lab, 8).sum()))
    """)
    env = _env()
    env.pop("TPDIAG_TRITON_CPU", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]


# --------------------------------------------------------------------------------------
# Negative controls on the stock torch reductions (this process, CPU torch)
# --------------------------------------------------------------------------------------
def _rank_order_sum(parts):
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def test_stock_vocab_sum_differs_across_tp():
    """One .sum over each rank's whole local vocab, then the ranks added (an all-reduce): not
    the bits of TP=1's one sum, for some row at some TP. This is what the fix removes."""
    g = torch.Generator().manual_seed(0)
    lo = torch.randn(16, 512, generator=g) * 3
    e = torch.exp(lo - lo.max(-1).values[:, None])
    full = e.sum(-1)
    differs = {tp: not same_bits(_rank_order_sum([c.contiguous().sum(-1) for c in e.chunk(tp, -1)]), full)
               for tp in (2, 4, 8)}
    assert any(differs.values()), differs


def test_stock_dgamma_sum_differs_across_tp():
    g = torch.Generator().manual_seed(1)
    terms = torch.randn(2, 64, 48, generator=g) * torch.randn(2, 64, 48, generator=g)
    full = terms.sum(dim=(0, 1))
    differs = {tp: not same_bits(_rank_order_sum([c.contiguous().sum(dim=(0, 1)) for c in terms.chunk(tp, 1)]),
                                 full) for tp in (2, 4, 8)}
    assert any(differs.values()), differs


# --------------------------------------------------------------------------------------
# Triton kernels under the interpreter (one subprocess for everything)
# --------------------------------------------------------------------------------------
_SCRIPT = textwrap.dedent("""
    import json
    import torch
    from tpdiag.kernels import grouped_linear as gl, invariant_gemm as ig, norm_grad as ng
    from tpdiag.kernels import norm_grad_triton as nt, tree, vocab_ce, vocab_ce_triton as vt

    IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    G = 8
    res = {}

    def same(x, y):
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
            x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype]))

    def rel(x, ref):
        return float((x.double() - ref).abs().max() / ref.abs().max())

    calls = {"vocab": 0, "norm": 0, "mm": 0}
    def counting(mod, name, key):
        f = getattr(mod, name)
        def wrapped(*a, **k):
            calls[key] += 1
            return f(*a, **k)
        setattr(mod, name, wrapped)
    counting(vt, "group_exp_sums", "vocab")
    counting(nt, "group_col_sums", "norm")
    counting(ig, "triton_mm", "mm")

    gen = torch.Generator().manual_seed(0)
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # ---- vocab: group sums of exp(l - m) -----------------------------------------------
        for s, blk in ((40, None), (40, 16), (36, 16)):   # one block; 3 blocks + tail; odd size
            key = f"vocab {dn} S{s} b{blk}"
            T = 7
            lo = (torch.randn(T, G * s, generator=gen) * 3).to(dt)
            m = lo.float().max(-1).values
            full = vt.group_exp_sums(lo, m, G, block=blk)
            res[key + " err"] = rel(full, vt.reference_group_exp_sums(lo, m, G))
            for tp in (2, 4, 8):
                k = G // tp
                res[f"{key} tp{tp}"] = [same(vt.group_exp_sums(c, m, k, block=blk), full[r * k:(r + 1) * k])
                                        for r, c in enumerate(lo.chunk(tp, -1))]
            res[key + " rows"] = [same(vt.group_exp_sums(lo[i:j], m[i:j], G, block=blk), full[:, i:j])
                                  for i, j in ((0, 1), (2, 5), (6, 7), (1, 7))]
            # (block 8 would not do: the interpreter's tl.sum is numpy's pairwise sum, whose 8
            # accumulators add in the very order of an 8-lane kernel accumulator)
            res[key + " other block differs"] = not same(vt.group_exp_sums(lo, m, G, block=4), full)
        # end to end (world 1): VocabParallelLogProb on the Triton path
        lo = (torch.randn(9, 256, generator=gen) * 3).to(dt)
        lab = torch.randint(0, 256, (9,), generator=gen)
        lab[-1] = vocab_ce.IGNORE
        n0 = calls["vocab"]
        x = lo.clone().requires_grad_(True)
        lp = vocab_ce.token_logprobs(x, lab, G)
        vocab_ce.cross_entropy(x, lab, G).backward()
        xr = lo.double().requires_grad_(True)
        torch.nn.functional.cross_entropy(xr, lab, ignore_index=vocab_ce.IGNORE).backward()
        res[f"vocab {dn} e2e"] = [calls["vocab"] > n0,
                                  float((lp.double() - vocab_ce.reference_logprobs(lo, lab)).abs().max()),
                                  float((x.grad.double() - xr.grad).abs().max())]

        # ---- norm: per-group dgamma columns, row means -----------------------------------
        for shape, gd in (((2, G * 6, 48), 1), ((2, 5, G * 2, 16), -2)):
            a = torch.randn(*shape, generator=gen).to(dt)
            b = torch.randn(*shape, generator=gen).to(dt)
            for blocking in (None, (8, 16, 16)):
                key = f"norm {dn} {shape} {blocking}"
                full = nt.group_col_sums(a, b, G, gd, blocking=blocking)
                res[key + " err"] = rel(full, nt.reference_group_col_sums(a, b, G, gd))
                for tp in (2, 4, 8):
                    k = G // tp
                    res[f"{key} tp{tp}"] = [
                        same(nt.group_col_sums(ca, cb, k, gd, blocking=blocking), full[r * k:(r + 1) * k])
                        for r, (ca, cb) in enumerate(zip(a.chunk(tp, gd), b.chunk(tp, gd)))]
                res[key + " alone"] = [same(nt.group_col_sums(ca, cb, 1, gd, blocking=blocking), full[i:i + 1])
                                       for i, (ca, cb) in enumerate(zip(a.chunk(G, gd), b.chunk(G, gd)))]
            res[f"norm {dn} {shape} other blocking differs"] = not same(
                nt.group_col_sums(a, b, G, gd, blocking=(8, 16, 16)), nt.group_col_sums(a, b, G, gd))
            key = f"rows {dn} {shape}"
            r_full, d_full = nt.row_rstd(a, 1e-5), nt.row_dot_mean(a, b)
            res[key + " err"] = [rel(r_full, nt.reference_row_rstd(a, 1e-5)),
                                 rel(d_full, nt.reference_row_dot_mean(a, b))]
            sl = (slice(1, 2), slice(3, 7))   # a row slice that cuts through tiles
            res[key + " slice"] = [same(nt.row_rstd(a[sl], 1e-5), r_full[sl]),
                                   same(nt.row_dot_mean(a[sl], b[sl]), d_full[sl])]
            res[key + " tp"] = [same(nt.row_rstd(c, 1e-5), rc) and same(nt.row_dot_mean(c, cb), dc)
                                for tp in (2, 4, 8)
                                for c, cb, rc, dc in zip(a.chunk(tp, gd), b.chunk(tp, gd),
                                                         r_full.chunk(tp, gd), d_full.chunk(tp, gd))]
        # end to end: RMSNormSP at simulated TP degrees (each rank its slice; dw tree finished here)
        x = torch.randn(2, G * 4, 32, generator=gen).to(dt)
        w = torch.rand(32, generator=gen) + 0.5
        gy = torch.randn(2, G * 4, 32, generator=gen)
        n0 = calls["norm"]
        outs = {}
        for world in (1, 2, 4, 8):
            ys, dxs, dws = [], [], []
            for xr, gr in zip(x.chunk(world, 1), gy.chunk(world, 1)):
                xr = xr.contiguous().requires_grad_(True)
                wr = w.clone().requires_grad_(True)
                y = ng.RMSNormSP.apply(xr, wr, 1e-5, G // world, 1)
                y.backward(gr.to(y.dtype))
                ys.append(y.detach()); dxs.append(xr.grad); dws.append(wr.grad)
            outs[world] = (torch.cat(ys, 1), torch.cat(dxs, 1), tree.tree_sum(dws))
        res[f"rmsnorm {dn} e2e"] = [calls["norm"] > n0] + [
            same(outs[wd][i], outs[1][i]) for wd in (2, 4, 8) for i in range(3)]
        res[f"rmsnorm {dn} err"] = rel(outs[1][0], ng.reference_rmsnorm(x, w, 1e-5))

        # ---- tp-invariant-linear: group GEMMs through triton_mm --------------------------
        xl = torch.randn(12, 256, generator=gen).to(dt)
        wl = torch.randn(48, 256, generator=gen).to(dt)
        gl_ = torch.randn(12, 48, generator=gen)
        n0 = calls["mm"]
        outs = {}
        for world in (1, 2, 4, 8):
            ys, dxs, dws = [], [], []
            for xr, wr in zip(xl.chunk(world, -1), wl.chunk(world, -1)):
                xr = xr.contiguous().requires_grad_(True)
                wr = wr.contiguous().requires_grad_(True)
                y = gl.RowLinearPartial.apply(xr, wr, G // world)
                y.backward(gl_)
                ys.append(y.detach()); dxs.append(xr.grad); dws.append(wr.grad)
            outs[world] = (tree.tree_sum(ys), torch.cat(dxs, -1), torch.cat(dws, -1))
        res[f"linear {dn} row"] = [calls["mm"] > n0] + [
            same(outs[wd][i], outs[1][i]) for wd in (2, 4, 8) for i in range(3)]
        res[f"linear {dn} rows slice"] = same(gl.RowLinearPartial.apply(xl[3:7], wl, G), outs[1][0][3:7])
        res[f"linear {dn} err"] = rel(outs[1][0], gl.reference_linear(xl, wl))
        # stock row-parallel on the same kernel: one GEMM per rank over its K/TP, ranks added in order
        full = ig.triton_mm(xl.float(), wl.float().t())
        res[f"linear {dn} stock differs"] = [
            not same(sum([ig.triton_mm(a.float(), b.float().t()) for a, b in zip(xl.chunk(tp, -1), wl.chunk(tp, -1))]),
                     full) for tp in (2, 4, 8)]
        # column-parallel tree dgrad (tp-invariant-linear on its own: forward stays stock). fp32
        # only: with one process each rank's dx is rounded to x's dtype before the cross-rank
        # tree here, which a real world does after it.
        if dt != torch.float32:
            continue
        xc = torch.randn(12, 64, generator=gen)
        wc = torch.randn(64, 64, generator=gen)
        dyc = torch.randn(12, 64, generator=gen)
        douts = {}
        for world in (1, 2, 4, 8):
            parts = []
            for wr, dr in zip(wc.chunk(world, 0), dyc.chunk(world, -1)):
                xr = xc.clone().requires_grad_(True)
                y = gl.ColLinear.apply(xr, wr.contiguous(), G // world, False, True)
                (dx,) = torch.autograd.grad(y, xr, dr.contiguous())
                parts.append(dx)
            douts[world] = tree.tree_sum(parts) if world > 1 else parts[0]
        res[f"linear {dn} col dgrad"] = [same(douts[wd], douts[1]) for wd in (2, 4, 8)]
    print("RESULT " + json.dumps(res))
""")


@pytest.fixture(scope="module")
def interp():
    return interpreter_result(_SCRIPT)


def _select(res, prefix, suffix):
    hits = {k: v for k, v in res.items() if k.startswith(prefix) and k.endswith(suffix)}
    assert hits, f"no results {prefix!r}...{suffix!r}"
    return hits


DTYPES = ["fp32", "bf16"]


@pytest.mark.parametrize("dt", DTYPES)
def test_vocab_group_sums_accuracy(interp, dt):
    for k, err in _select(interp, f"vocab {dt} S", " err").items():
        assert err < 1e-6, (k, err)
    ok, lp_err, grad_err = interp[f"vocab {dt} e2e"]
    assert ok, "VocabParallelLogProb did not take the Triton path under TPDIAG_TRITON_CPU=1"
    # the logit grad is returned in the logits' dtype: bf16 rounding (2**-9 relative) bounds it
    assert lp_err < 1e-5 and grad_err < {"fp32": 1e-6, "bf16": 1e-3}[dt], (lp_err, grad_err)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("dt", DTYPES)
def test_vocab_group_sums_tp_bitwise(interp, dt, tp):
    for k, v in _select(interp, f"vocab {dt} S", f" tp{tp}").items():
        assert all(v), (k, v)


@pytest.mark.parametrize("dt", DTYPES)
def test_vocab_group_sums_rows_bitwise(interp, dt):
    for k, v in _select(interp, f"vocab {dt} S", " rows").items():
        assert all(v), (k, v)


@pytest.mark.parametrize("dt", DTYPES)
def test_vocab_negative_control_other_block(interp, dt):
    """Another block is another order: the bitwise comparison above would see it."""
    for k, v in _select(interp, f"vocab {dt} S", " other block differs").items():
        assert v, k


@pytest.mark.parametrize("dt", DTYPES)
def test_norm_group_col_sums(interp, dt):
    for k, err in _select(interp, f"norm {dt} ", " err").items():
        assert err < 1e-6, (k, err)
    for tp in (2, 4, 8):
        for k, v in _select(interp, f"norm {dt} ", f" tp{tp}").items():
            assert all(v), (k, v)
    for k, v in _select(interp, f"norm {dt} ", " alone").items():
        assert all(v), (k, v)
    for k, v in _select(interp, f"norm {dt} ", " other blocking differs").items():
        assert v, k


@pytest.mark.parametrize("dt", DTYPES)
def test_norm_row_means(interp, dt):
    for k, errs in _select(interp, f"rows {dt} ", " err").items():
        assert max(errs) < 1e-6, (k, errs)
    for k, v in _select(interp, f"rows {dt} ", " slice").items():
        assert all(v), (k, v)
    for k, v in _select(interp, f"rows {dt} ", " tp").items():
        assert all(v), (k, v)


@pytest.mark.parametrize("dt", DTYPES)
def test_rmsnorm_sp_end_to_end_bitwise(interp, dt):
    v = interp[f"rmsnorm {dt} e2e"]
    assert v[0], "RMSNormSP did not take the Triton path under TPDIAG_TRITON_CPU=1"
    assert all(v[1:]), v   # y, dx, dgamma at TP=2/4/8 == TP=1
    assert interp[f"rmsnorm {dt} err"] < {"fp32": 1e-6, "bf16": 1e-2}[dt]


@pytest.mark.parametrize("dt", DTYPES)
def test_linear_groups_on_triton_mm(interp, dt):
    v = interp[f"linear {dt} row"]
    assert v[0], "RowLinearPartial did not call triton_mm under TPDIAG_TRITON_CPU=1"
    assert all(v[1:]), v   # forward subtree roots, dgrad, wgrad at TP=2/4/8 == TP=1
    assert interp[f"linear {dt} rows slice"]
    assert interp[f"linear {dt} err"] < 1e-5
    if dt == "fp32":
        assert all(interp[f"linear {dt} col dgrad"]), interp[f"linear {dt} col dgrad"]
    # stock row-parallel partials on the same kernel are not TP-invariant
    assert any(interp[f"linear {dt} stock differs"]), interp[f"linear {dt} stock differs"]


def test_gpu_script_smoke(tmp_path):
    """`python -m benchmarks tree-kernels`'s checks, on tiny shapes under the interpreter (fp32 only)."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--no-record", "tree-kernels", "--smoke",
                        "--dtypes", "fp32", "--out", str(tmp_path)], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rep = json.loads((tmp_path / "tree_kernels.json").read_text())
    assert rep["ok"] and len(rep["checks"]) > 20
