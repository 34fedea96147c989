"""invariant-attention's one-pass backward with dq on a per-row fixed-point grid (AttnConfig.dq_fixed)
under the Triton interpreter (CPU; per-element integer atomics - the GPU takes TMA bulk reductions,
checked by the attention job's --variant dq_fixed=32 / 64 runs): dk and dv are the recompute path's
bits, dq is invariant across head slices (GQA: 2 query heads a KV head), batch rows and reruns, and
no less accurate than the recompute's against a float64 reference. Negative controls: a bound too
small for the grid (sums wrap: the accuracy check fails) and a row scale read from the launch's
first KV head instead of the row's own (the head slices differ)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
import torch
from dataclasses import replace
from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb
from tpdiag.kernels import attention_triton_bwd_fixed as fx
sys.path.insert(0, "tests")
from module_copy import patched
# negative controls: a bound 4e6 times too small for the grid; a row scale from the launch's
# first KV head instead of the row's own
small_bound = patched(fx, "bound = 4.0 * tl.sum(", "bound = 1e-6 * tl.sum(", "fx_small")
first_head = patched(fx, "kv = tl.load(KV + bh // REP)", "kv = tl.load(KV + 0 * bh)", "fx_first")
def bits(t): return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
def beq(a, b): return a.shape == b.shape and torch.equal(bits(a), bits(b))
def both(q, k, v, do, causal, cfg, m=fx):
    o, lse = at.forward(q, k, v, causal, 0.25, cfg)
    if cfg.dq_fixed:
        return (o,) + tuple(m.fixed_pass(do.contiguous(), q, k, v, o, lse, causal, 0.25, cfg))
    return (o,) + tuple(atb.backward(do, q, k, v, o, lse, causal, 0.25, cfg))
def dq_err(dq, q, k, v, do, causal):  # max |dq - dq of a float64 reference|
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) * 0.25
    if causal:  # top-left aligned, as the kernels (L <= S here)
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(s, -1) @ vd.repeat_interleave(rep, 1)).backward(do.double())
    return float((dq.double() - qd.grad).abs().max())
small = at.AttnConfig(16, 16, 4, 1, 16, 32, 4, 1, 32, 16, 4, 1, kv_group=2)
res = {}
for name, dt, L, S, causal, nbits in (("fp32-causal-L<S", torch.float32, 24, 40, True, 32),
                                      ("bf16-L>S", torch.bfloat16, 40, 24, False, 64)):
    g = torch.Generator().manual_seed(L * S)
    q, do = (torch.randn(2, 4, L, 16, generator=g).to(dt) for _ in range(2))  # GQA: 2 query heads a KV head
    k, v = (torch.randn(2, 2, S, 16, generator=g).to(dt) for _ in range(2))
    c = replace(small, dq_fixed=nbits)
    full, rec = both(q, k, v, do, causal, c), both(q, k, v, do, causal, small)
    half = both(q[:, 2:], k[:, 1:], v[:, 1:], do[:, 2:], causal, c)
    r = res[name] = {
        "dkdv_as_recompute": [beq(full[2], rec[2]), beq(full[3], rec[3])],
        "heads": [beq(a, b) for a, b in zip(half, (full[0][:, 2:], full[1][:, 2:], full[2][:, 1:], full[3][:, 1:]))],
        "dq_err": dq_err(full[1], q, k, v, do, causal), "rec_dq_err": dq_err(rec[1], q, k, v, do, causal)}
    if nbits == 32:  # batch rows and a rerun; the control whose scale leaks across heads
        one = both(q[1:], k[1:], v[1:], do[1:], causal, c)
        r["batch"] = [beq(a, b[1:]) for a, b in zip(one, full)]
        r["repro"] = [beq(a, b) for a, b in zip(both(q, k, v, do, causal, c), full)]
        bad_full = both(q, k, v, do, causal, c, first_head)
        bad_half = both(q[:, 2:], k[:, 1:], v[:, 1:], do[:, 2:], causal, c, first_head)
        r["first_head_dq_heads"] = beq(bad_half[1], bad_full[1][:, 2:])
    else:
        r["small_bound_dq_err"] = dq_err(both(q, k, v, do, causal, c, small_bound)[1], q, k, v, do, causal)
print("RESULT", json.dumps(res))
"""


def _script():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])


def test_fixed_point_dq_is_invariant_and_as_accurate_as_the_recompute():
    res = _script()
    for case, r in res.items():
        assert r["dkdv_as_recompute"] == [True, True], (case, r)
        assert all(r["heads"]) and all(r.get("batch", [True])) and all(r.get("repro", [True])), (case, r)
        # the grid holds each partial to 2^(3 - bits) of the row's bound: dq's error is the recompute's
        # fp32 sum's or less (the last rounding to the output dtype dominates both)
        assert r["dq_err"] <= r["rec_dq_err"], (case, r)
    assert "batch" in res["fp32-causal-L<S"]
    # negative controls: a bound too small wraps the integer sums (dq wrong); a row scale from the
    # launch's first KV head gives the second head slice other dq bits (fp32: the grid shows through)
    assert res["bf16-L>S"]["small_bound_dq_err"] > 20 * res["bf16-L>S"]["rec_dq_err"], res
    assert res["fp32-causal-L<S"]["first_head_dq_heads"] is False, res
