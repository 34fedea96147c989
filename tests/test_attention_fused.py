"""invariant-attention's one-launch recompute backward (AttnConfig.bwd_fused) and the D=64 tiles
under the Triton interpreter (CPU), and the attention job's `--configs` sweep: its checks can
fail, and its smoke run times and checks the shipped and a fused config side by side."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
import torch
from dataclasses import replace
from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb
sys.path.insert(0, "tests")
from module_copy import patched
_empty = torch.empty
def _poisoned(*a, **k):  # an output element no program writes reads as NaN, never as the bits a
    t = _empty(*a, **k)  # freed tensor of the same size left (the CPU allocator reuses blocks)
    return t.fill_(float("nan")) if t.is_floating_point() else t
shipped_atb = atb
def backward_for(mode):
    # the backward module a mode runs: the shipped one, or its negative control's copy (made after
    # the mode's torch.empty is set, as in a process of its own)
    if mode == "no-delta":  # a negative control: the fused launch without its delta pass
        return patched(shipped_atb, "delta = delta_pass(do, o, cfg)  # complete before",
                       "delta = torch.zeros_like(lse)  #", "atb_nodelta")
    if mode == "stops-and-wrong-half":  # negative controls in one mode: each persistent dk/dv
        # program takes one tile only, and the split loop's second half re-reads the first half's rows
        from tpdiag.kernels import attention_triton_bwd_programs as programs
        patched(programs, "rb = ra + HM", "rb = ra", "programs_wronghalf")
        b = patched(shipped_atb, "from tpdiag.kernels.attention_triton_bwd_programs import",
                    "from programs_wronghalf import", "atb_wronghalf")
        return patched(b, "SPLIT)\n            t = tl.atomic_add(CTR, 1)", "SPLIT)\n            t = NB * BH", "atb_stops")
    if mode == "mix-reads-all":  # a negative control: dq reads dS where the dk/dv pass kept none
        # (set in the shipped module, the mode runs last: restored after it all the same)
        from tpdiag.kernels import attention_triton_bwd_programs as programs
        shipped_atb._dq_mix_kernel = patched(programs, "if (start_n // KV_N) % EVERY == 0:", "if True:",
                                             "programs_mixall")._dq_mix_kernel
    return shipped_atb
def bits(t): return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
def beq(a, b): return a.shape == b.shape and torch.equal(bits(a), bits(b))
def both(q, k, v, do, causal, cfg):
    o, lse = at.forward(q, k, v, causal, 0.125, cfg)
    return (o,) + tuple(atb.backward(do, q, k, v, o, lse, causal, 0.125, cfg))
d64 = at.config_for(torch.bfloat16, 64)  # the shipped D=64 tiles (128-row blocks: L = 40 is one, masked)
small = at.AttnConfig(16, 16, 4, 1, 16, 32, 4, 1, 32, 16, 4, 1)
stored = at.AttnConfig(16, 16, 4, 1, 16, 16, 4, 1, 32, 16, 4, 1, ds_mib=1)
halves = at.AttnConfig(16, 16, 4, 1, 32, 32, 4, 1, 32, 16, 4, 1)  # kv_split: halves of 16 query rows
cases = (("d64-bf16-causal", torch.bfloat16, 40, 40, True, d64, ("two-launch", "fused")),
         ("small-fp32-causal-L<S", torch.float32, 24, 40, True, small, ("two-launch", "fused-groups-tma", "persist-tma")),
         ("small-fp32-L>S", torch.float32, 40, 24, False, small, ("fused",)),
         ("stored-bf16-causal", torch.bfloat16, 40, 40, True, stored, ("mix-2",)),
         ("halves-bf16-causal", torch.bfloat16, 40, 40, True, halves, ("split-tma",)))
variants = {"two-launch": {"bwd_fused": False}, "fused": {"bwd_fused": True},
            "fused-groups-tma": {"bwd_fused": True, "bwd_tma": True, "kv_group": 3, "q_group": 2},
            "mix-2": {"ds_every": 2, "q_group": 2},
            # persistent passes (2 programs per "SM" here: fewer programs than tiles) with TMA loads
            # in both backward loops
            "persist-tma": {"kv_persist": 2, "q_persist": 1, "dq_tma": True, "bwd_tma": True, "q_group": 2},
            "split-tma": {"kv_split": True, "q_persist": 1, "bwd_tma": True, "dq_tma": True}}
# the modes in one interpreter (each as its own process ran it: its torch.empty, its module copies, the
# generator from seed 0): torch's and Triton's imports once, not once a mode
done = {}
_dq_mix_shipped = shipped_atb._dq_mix_kernel
for mode in sys.argv[1].split(","):
    # poisoned but in mix-reads-all: that control tells its NaN-filled dS scratch from the run's own
    torch.empty = _empty if mode == "mix-reads-all" else _poisoned
    atb = backward_for(mode)
    g = torch.Generator().manual_seed(0)
    res = done[mode] = {}
    picked = {"no-delta": cases[1:2], "mix-reads-all": cases[3:4],
              "stops-and-wrong-half": cases[1:2] + cases[4:]}.get(mode, cases)
    for name, dt, L, S, causal, cfg, tags in picked:
        D = 64 if cfg is d64 else 16
        q, do = (torch.randn(2, 4, L, D, generator=g).to(dt) for _ in range(2))
        k, v = (torch.randn(2, 2, S, D, generator=g).to(dt) for _ in range(2))
        two = both(q, k, v, do, causal, replace(cfg, bwd_fused=False))  # the shipped D=64 entry is fused
        for tag in tags:
            c = replace(cfg, **variants[tag])
            full = two if tag == "two-launch" else both(q, k, v, do, causal, c)
            half = both(q[:, 2:], k[:, 1:], v[:, 1:], do[:, 2:], causal, c)
            one = both(q[1:], k[1:], v[1:], do[1:], causal, c)
            res[f"{name}/{tag}"] = {
                "same_as_two_launch": [beq(a, b) for a, b in zip(full, two)],
                "heads": all(beq(a, b) for a, b in zip(half, (full[0][:, 2:], full[1][:, 2:], full[2][:, 1:],
                                                              full[3][:, 1:]))),
                "batch": all(beq(a, b[1:]) for a, b in zip(one, full)),
                "repro": all(beq(a, b) for a, b in zip(both(q, k, v, do, causal, c), full)),
                "close": [bool(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)) for a, b in zip(full, two)]}
            if c.ds_every:  # the key blocks whose dS the dk/dv pass did not keep are never read
                o, lse = at.forward(q, k, v, causal, 0.125, c)
                nan = atb._backward_ds(do, q, k, v, o, lse, causal, 0.125, c, chunk=1,
                                       ds=torch.full((2, S, L), float("nan"), dtype=dt))
                res[f"{name}/{tag}"]["poison_unread"] = all(beq(a, b) for a, b in zip(nan, full[1:]))
    shipped_atb._dq_mix_kernel = _dq_mix_shipped
torch.empty = _empty
print("RESULT", json.dumps(done))
"""


def _script(*modes):
    """{mode: its results}, the modes run one after another in one interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(modes)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])


def test_fused_and_mixed_backwards_give_the_two_launch_bits_and_stay_invariant():
    # the shipped kernels first, then the negative controls (mix-reads-all last: it sets a kernel of the
    # shipped module, which the script puts back after it)
    every = _script("shipped", "no-delta", "stops-and-wrong-half", "mix-reads-all")
    res = every["shipped"]
    assert len(res) == 8
    for case, r in res.items():
        assert r["heads"] and r["batch"] and r["repro"], (case, r)  # TP head slices, batch rows, reruns
        assert all(r["close"]), (case, r)
        if case.endswith("/split-tma"):
            # o and dq are the two-launch bits; the split dk/dv loop sums a 32-row product as two
            # 16-row ones: on the GPU the same k16 chunks into the same accumulator (the same bits
            # on an H200: docs/benchmarks.md), under the interpreter two numpy matmuls (other bits)
            assert r["same_as_two_launch"][:2] == [True, True], (case, r)
            continue
        # o, dq, dk, dv; the mixed dq (ds_every) == the stored-dS path's, in bf16 (fp32 dS would be
        # summed in another order by each pass); the persistent passes' tiles the one-a-program bits
        assert r["same_as_two_launch"] == [True] * 4, (case, r)
        assert r.get("poison_unread", True), (case, r)
    assert "poison_unread" in res["stored-bf16-causal/mix-2"]
    # negative control: without its delta pass the fused launch's dk is other bits (the check reads them)
    bad = every["no-delta"]
    assert not bad["small-fp32-causal-L<S/fused-groups-tma"]["same_as_two_launch"][2], bad
    # and dq reading every block's dS, kept or not, reads the NaN poison the dk/dv pass left
    bad = every["mix-reads-all"]
    assert not any(r["poison_unread"] for r in bad.values()), bad
    # persistent dk/dv programs that stop after one tile leave tiles unwritten (the small case: no
    # split loop there): other dk, dv; the split loop's second half reading the first half's rows:
    # dk, dv wrong
    bad = every["stops-and-wrong-half"]
    assert bad["small-fp32-causal-L<S/persist-tma"]["same_as_two_launch"][2:] == [False, False], bad
    assert bad["halves-bf16-causal/split-tma"]["close"][2:] == [False, False], bad


def test_config_sweep_checks_can_fail():
    """The sweep's invariance checks on functions that are not invariant: a head count or batch size
    leaking into the values, and different bits from the reference."""
    from benchmarks import attention_configs as ac

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(4))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fine = ac._checks(torch, lambda q, k, v: sdpa(q, k, v) * 1.0, q, k, v, do, ref=ac._run(torch, sdpa, q, k, v, do))
    assert ac._invariant(fine) and all(fine["same_bits"].values())
    heads = ac._checks(torch, lambda q, k, v: sdpa(q, k, v) * q.shape[1], q, k, v, do, tps=(2, 4))
    assert not heads["tp2"]["o"] and not heads["tp4"]["o"] and heads["batch"]["o"] and not ac._invariant(heads)
    rows = ac._checks(torch, lambda q, k, v: sdpa(q, k, v) * q.shape[0], q, k, v, do,
                      ref=ac._run(torch, sdpa, q, k, v, do))
    assert not rows["batch"]["o"] and rows["tp2"]["o"] and not any(rows["same_bits"].values())
    assert not ac.rows_ok({"rows": {"inv:x": {"invariant": False}}}) and ac.rows_ok({"rows": {"sdpa-math": {}}})


def test_combo_joins_the_fastest_forward_and_backward_changes():
    from benchmarks.attention_configs import _combo

    def r(fwd, both, **changes):
        return {"fwd_ms": fwd, "fwdbwd_ms": both, "invariant": True, "changes": changes}
    rows = {"sdpa-cudnn": {"fwd_ms": 1.0, "fwdbwd_ms": 4.0}, "inv:shipped": r(1.5, 5.5),
            "inv:fw4": r(1.4, 5.6, fwd_warps=4), "inv:fs2": r(1.45, 5.3, fwd_stages=2),
            "inv:fused": r(1.5, 5.4, bwd_fused=1), "inv:kv": r(1.6, 5.55, kv_stages=2),
            "inv:both": r(1.0, 3.0, fwd_warps=8, bwd_tma=1),  # touches both passes: not a part
            "inv:broken": {**r(1.0, 1.1, q_warps=2), "invariant": False}}
    assert _combo(rows) == {"fwd_warps": 4, "bwd_fused": 1}  # fastest forward 1.4, backward 3.9
    # exp2 by polynomial in the forward's loop too (exp_soft bit 4) touches both passes: not a part
    rows["inv:soft-all"] = r(1.45, 3.0, exp_soft=7, exp_soft_every=4)
    assert _combo(rows) == {"fwd_warps": 4, "bwd_fused": 1}
    rows["inv:soft-all"]["changes"]["exp_soft"] = 3  # the backward's loops only: a backward change
    assert _combo(rows) == {"fwd_warps": 4, "exp_soft": 3, "exp_soft_every": 4}
    del rows["inv:soft-all"]
    rows["inv:fused"]["fwdbwd_ms"] = rows["inv:kv"]["fwdbwd_ms"] = 6.0  # no backward change pays
    assert _combo(rows) is None


def test_configs_smoke_times_and_checks_shipped_and_fused(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "configs.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--no-record", "attention", "--configs", "d64-only",
                        "--smoke", "--only", "fused", "--rounds", "1", "--json", str(out)],
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] and list(res["dims"]) == ["64"]
    d = res["dims"]["64"]
    rows = d["rows"]
    assert set(rows) == {"sdpa-math", "inv:shipped", "inv:fused"} and d["fastest_stock"] == "sdpa-math"
    for n in ("inv:shipped", "inv:fused"):
        c = rows[n]["checks"]
        assert rows[n]["invariant"] and set(c) == {"repro", "tp2", "batch", "same_bits"}, (n, c)
        assert all(c["same_bits"].values()) and rows[n]["x_fastest_stock"] > 0 and len(rows[n]["rounds_ms"]) == 1
    assert rows["inv:fused"]["changes"] == {"bwd_fused": 1}
    assert d["best"] in ("inv:shipped", "inv:fused") and "HEAD_DIM_CONFIGS entry" in p.stdout
    assert set(d["passes"]) == {"fwd", "delta", "dq", "dkdv", "fused", "stock-fwd", "stock-bwd"}
    assert all(x["ms"] > 0 for x in d["passes"].values())


def test_kernels_compile_for_sm90_with_one_exp2_a_pair():
    """The D=64 kernels - the fused launch among them, which the interpreter runs but never
    compiles - compiled for sm_90 on the CPU (Triton's bundled ptxas, `attention --sass`): every
    innermost loop holds tensor-core products and one MUFU (exp2) per (query, key) pair a thread
    holds; the fused kernel's four loops are the dk/dv pass's two and the dq pass's two."""
    pytest.importorskip("triton")
    code = """
import dataclasses, json
from benchmarks.attention_sass import _compile, _kernels, _loops
from tpdiag.kernels import attention_triton as at
out = {}
try:
    for p, (k, types, consts, warps, stages, bm, bn, _) in _kernels(dataclasses.replace(at.D64, bwd_fused=True), 64).items():
        out[p] = {"loops": _loops(_compile(k, types, consts, warps, stages)[0]), "warps": warps}
except FileNotFoundError as e:  # a Triton build without the CUDA tools
    out = {"skip": str(e)}
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(env, PYTHONPATH=ROOT), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"no ptxas/cuobjdump in this Triton: {got['skip']}")
    from tpdiag.kernels import attention_triton as at

    cfg = at.D64
    fused, fwd = got["fused"]["loops"], got["fwd"]["loops"]
    assert len(fused) == 4 and len(fwd) == 2
    assert all(lp["HGMMA"] > 0 for lp in fused + fwd)
    # dk/dv loops: kv_m x kv_n pairs, dq loops: q_m x q_n, over 32 lanes x the launch's warps
    per_thread = [cfg.kv_m * cfg.kv_n // (32 * cfg.kv_warps)] * 2 + [cfg.q_m * cfg.q_n // (32 * cfg.kv_warps)] * 2
    assert [lp["MUFU"] for lp in fused] == per_thread
    # the forward adds one exp2 for each row a thread holds (the running max's rescale)
    pairs = cfg.fwd_m * cfg.fwd_n // (32 * cfg.fwd_warps)
    assert all(pairs < lp["MUFU"] <= pairs + 4 for lp in fwd), fwd
