"""exp2 partly by a polynomial on the FMA pipe (AttnConfig.exp_soft, kernels/exp2_soft.py) under
the Triton interpreter (CPU): the polynomial against float64 exp2, which columns take it, and the
attention kernels with it - gradients within the bf16 tolerance of test_invariant_attention,
TP=2 head slices, batch halves, reruns and a shorter sequence's rows bitwise, with a negative
control whose choice of elements follows the launch (program id) and so the head count."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLY = r"""
import json, sys
import torch, triton, triton.language as tl
from tpdiag.kernels import exp2_soft as es

@triton.jit
def tile(X, Y, R: tl.constexpr, C: tl.constexpr, EVERY: tl.constexpr, DEG: tl.constexpr):
    o = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(Y + o, es.exp2_mixed(tl.load(X + o), R, C, EVERY, DEG))

def run(x, every, deg):
    y = torch.empty_like(x)
    tile[(1,)](x, y, x.shape[0], x.shape[1], every, deg)
    return y

res = {}
# every fp32 spacing near the reduction's edges (j +- 1/2) and whole numbers, and a dense grid
# over the range a softmax's exponent takes (<= 0, where 2^x underflows below -126)
g = torch.Generator().manual_seed(0)
grid = torch.linspace(-126.0, 8.0, 64 * 256)
edges = torch.tensor([j + d for j in range(-40, 8) for d in (-0.5, 0.5, 0.0)])
edges = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
x = torch.cat([grid, edges])
x = torch.cat([x, torch.rand(512 * 64 - x.numel(), generator=g) * -30]).reshape(512, 64)
ref = torch.exp2(x.double())
for deg in (3, 4, 5):
    y = run(x, 1, deg)
    res[f"rel_err_{deg}"] = float(((y.double() - ref).abs() / ref).max())
    res[f"bf16_same_{deg}"] = float((y.bfloat16() == torch.exp2(x).bfloat16()).double().mean())
lo = torch.tensor([-127.0, -200.0, -1e30, float("-inf")] * 16).reshape(1, 64)
res["below_range_zero"] = bool((run(lo, 1, 3) == 0).all())
# which columns take the polynomial: EVERY 2 the odd ones, 4 those at 9, 11, 13, 15 mod 16; the rest exp2's bits
x = (torch.randn(16, 64, generator=g) * 8 - 8).float()
mufu, poly = run(x, 0, 3), run(x, 1, 3)
res["poly_ne_exp2_cols"] = int((poly != mufu).any(0).sum())
for every in (2, 4):
    y = run(x, every, 3)
    c = torch.arange(64)
    cols = c % 2 == 1 if every == 2 else torch.isin(c % 16, torch.tensor([9, 11, 13, 15]))
    res[f"every{every}_cols"] = bool(torch.equal(y[:, cols], poly[:, cols])
                                     and torch.equal(y[:, ~cols], mufu[:, ~cols]))
print("RESULT", json.dumps(res))
"""

ATTN = r"""
import json, sys
import torch
from dataclasses import replace
from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb
from tpdiag.kernels.attention import reference_sdpa
sys.path.insert(0, "tests")
from module_copy import patched
shipped_atb = atb
def backward_for(mode):
    if mode != "by-program":
        return shipped_atb
    # negative control: the dq loop's soft columns in every third program only
    from tpdiag.kernels import attention_triton_bwd_programs as programs
    patched(programs, "p = exp2_mixed(s - lse[:, None], BM, BN, SOFT, DEG)",
            "p = tl.where(tl.program_id(0) % 3 == 0, exp2_mixed(s - lse[:, None], BM, BN, SOFT, DEG), "
            "tl.math.exp2(s - lse[:, None]))", "programs_byprogram")
    return patched(shipped_atb, "from tpdiag.kernels.attention_triton_bwd_programs import (",
                   "from programs_byprogram import (", "atb_byprogram")
def bits(t): return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
def beq(a, b): return a.shape == b.shape and torch.equal(bits(a), bits(b))
def both(q, k, v, do, causal, cfg):
    o, lse = at.forward(q, k, v, causal, 0.25, cfg)
    return (o,) + tuple(atb.backward(do, q, k, v, o, lse, causal, 0.25, cfg))
# tiny tiles (multiples as the shipped ones); the soft variants at degree 3 unless named
base = at.AttnConfig(32, 16, 4, 1, 16, 32, 4, 1, 32, 16, 4, 1, fwd_tma=False)
variants = {"dq": dict(exp_soft=1), "kv": dict(exp_soft=2), "all-q": dict(exp_soft=7, exp_soft_every=4)}
# the modes in one interpreter, each as its own process ran it (its module copies, the generator from
# seed 0): torch's and Triton's imports once
done = {}
for mode in sys.argv[1].split(","):
    atb = backward_for(mode)
    g = torch.Generator().manual_seed(0)
    res = done[mode] = {}
    cases = [(torch.bfloat16, 40, 40, True, ("dq", "kv", "all-q")), (torch.bfloat16, 24, 40, False, ("all-q",))]
    if mode == "by-program":
        cases = [(torch.bfloat16, 40, 40, True, ("dq",))]
    neg = mode == "by-program"
    for dt, L, S, causal, tags in cases:
        q, do = (torch.randn(2, 4, L, 16, generator=g).to(dt) for _ in range(2))
        k, v = (torch.randn(2, 2, S, 16, generator=g).to(dt) for _ in range(2))
        if not neg:
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            r = reference_sdpa(q64, k64, v64, is_causal=causal, scale=0.25, enable_gqa=True)
            r.backward(do.double())
            refs = (r.detach(), q64.grad, k64.grad, v64.grad)
            plain = both(q, k, v, do, causal, base)
        for tag in tags:
            c = replace(base, **variants[tag])
            full = both(q, k, v, do, causal, c)
            half = both(q[:, 2:], k[:, 1:], v[:, 1:], do[:, 2:], causal, c)
            out = res[f"{dt}-{L}-{S}-{causal}/{tag}"] = {
                "heads": [beq(a, b) for a, b in zip(half, (full[0][:, 2:], full[1][:, 2:], full[2][:, 1:],
                                                           full[3][:, 1:]))]}
            if neg:
                continue
            one = both(q[1:], k[1:], v[1:], do[1:], causal, c)
            out["batch"] = [beq(a, b[1:]) for a, b in zip(one, full)]
            # o, dq, dk, dv: which of them the soft loops moved off exp2's bits
            out["same_as_exp2"] = [beq(a, b) for a, b in zip(full, plain)]
            out["err"] = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(full, refs))
            if tag == "dq":  # the one-launch backward hands each loop its own choice (dq's, not dk/dv's)
                out["fused"] = all(beq(a, b) for a, b in zip(both(q, k, v, do, causal, replace(c, bwd_fused=True)), full))
            if tag == "all-q":  # every soft loop at once: reruns, and (causal) a shorter sequence's rows -
                # o and dq of the first 24 queries see the first 24 keys only
                out["repro"] = all(beq(a, b) for a, b in zip(both(q, k, v, do, causal, c), full))
                if causal:
                    short = both(q[:, :, :24], k[:, :, :24], v[:, :, :24], do[:, :, :24], causal, c)
                    out["prefix"] = [beq(short[0], full[0][:, :, :24]), beq(short[1], full[1][:, :, :24])]
print("RESULT", json.dumps(done))
"""


def _script(src, *args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", src, *args], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])


def test_polynomial_exp2_against_float64_and_its_columns():
    pytest.importorskip("triton")
    from tpdiag.kernels.exp2_soft import MAX_REL_ERR

    res = _script(POLY)
    for deg in (3, 4, 5):
        # far below a bf16 P's own rounding (2^-9 relative, half its spacing)
        assert res[f"rel_err_{deg}"] <= MAX_REL_ERR[deg] < 2 ** -9 / 15, res
    # rounded to bf16 as P is for the products, the polynomial's 2^x is exp2's nearly everywhere
    assert res["bf16_same_3"] > 0.95 and res["bf16_same_5"] > 0.999, res
    assert res["below_range_zero"], res
    # the polynomial gives other bits than exp2 in (nearly) every column - else the column checks
    # below could not tell the two apart
    assert res["poly_ne_exp2_cols"] == 64, res
    assert res["every2_cols"] and res["every4_cols"], res


def test_soft_exp2_attention_is_accurate_and_invariant():
    pytest.importorskip("triton")
    every = _script(ATTN, "shipped,by-program")  # one interpreter, the negative control after
    res = every["shipped"]
    assert len(res) == 4 and "repro" in res["torch.bfloat16-40-40-True/all-q"]
    assert "prefix" in res["torch.bfloat16-40-40-True/all-q"]
    assert res["torch.bfloat16-40-40-True/dq"]["fused"]
    # o, dq, dk, dv the same bits as with exp2 alone: each loop moves its own outputs only, and the
    # forward's o moves all four
    moved = {"dq": [True, False, True, True], "kv": [True, True, False, False], "all-q": [False] * 4}
    for case, r in res.items():
        tag = case.split("/")[1]
        assert all(r["heads"]) and all(r["batch"]) and r.get("repro", True), (case, r)  # TP=2 heads, batch, reruns
        assert r.get("prefix", [True, True]) == [True, True], (case, r)  # not by the sequence length
        assert r["err"] < 2e-2, (case, r)  # test_invariant_attention's bf16 tolerance
        assert r["same_as_exp2"] == moved[tag], (case, r)
    # negative control: the same soft dq loop with its choice of elements by program id (so by the
    # heads and batch rows before a program's in the launch): the TP=2 head slices' dq is other
    # bits, caught
    bad = every["by-program"]
    assert len(bad) == 1
    assert all(not r["heads"][1] and all(r["heads"][i] for i in (0, 2, 3)) for r in bad.values()), bad


SASS = r"""
import dataclasses, json
from benchmarks.attention_sass import _compile, _kernels, _loops
from tpdiag.kernels import attention_triton as at
out = {}
try:
    # the dq pass with a quarter of its exp2s by polynomial, the dk/dv pass with half
    cfg = dataclasses.replace(at.D64, exp_soft=3, exp_soft_every=4)
    for p, ch in (("dq", {}), ("dkdv", {"exp_soft_every": 2})):
        k, types, consts, warps, stages, *_ = _kernels(dataclasses.replace(cfg, **ch), 64)[p]
        out[p] = {"loops": _loops(_compile(k, types, consts, warps, stages)[0]), "warps": warps}
except FileNotFoundError as e:  # a Triton build without the CUDA tools
    out = {"skip": str(e)}
print(json.dumps(out))
"""


def test_soft_loops_compile_for_sm90_with_fewer_mufu_and_no_spills():
    """Compiled for sm_90 on the CPU (Triton's bundled ptxas, `attention --sass`): the soft
    columns leave the MUFU (the dq loops 3/4 of an exp2 a pair, the dk/dv loops 1/2), their
    polynomial's three FFMAs a column appear, and the column split stays in registers: no local
    memory in the loops (c % 4 == 3 as the quarter spilled there: 5 and 2 loads an iteration)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SASS], capture_output=True, text=True, cwd=ROOT,
                       env=dict(env, PYTHONPATH=ROOT), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"no ptxas/cuobjdump in this Triton: {got['skip']}")
    from tpdiag.kernels import attention_triton as at

    cfg = at.D64
    for p, tm, tn, warps, soft in (("dq", cfg.q_m, cfg.q_n, cfg.q_warps, 4),
                                   ("dkdv", cfg.kv_n, cfg.kv_m, cfg.kv_warps, 2)):
        loops = got[p]["loops"]
        pairs = tm * tn // (32 * warps)  # (query, key) pairs a thread holds an iteration
        assert len(loops) == 2 and all(lp["HGMMA"] > 0 for lp in loops), (p, loops)
        assert [lp["MUFU"] for lp in loops] == [pairs - pairs // soft] * 2, (p, loops)
        assert all(lp["FFMA"] >= pairs + 3 * (pairs // soft) for lp in loops), (p, loops)
        assert all(lp["LDL"] == 0 and lp["STL"] == 0 for lp in loops), (p, loops)
