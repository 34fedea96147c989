"""The GPU warm-up's plan (runner/warm.py), read on the CPU: which kernel variants it compiles
ahead of the worlds and in what order - the record hash's batch kernel (what every first-pass
world launches first) before its one-record kernel, and tp-invariant-linear's GEMMs (needed only
by the confirmation, after the second pass) last, on the model's own Linear shapes."""
from __future__ import annotations

import torch

from tpdiag.config import CompareConfig
from tpdiag.models.presets import PRESETS
from tpdiag.runner import warm


def test_batch_variants_lead_and_fix_gemms_come_last():
    spec = ("llama-1b", "stock", "bfloat16", 1, 2048, 2, True, True)
    steps = warm.plan(["bfloat16", "float32"], spec)
    kinds = [s[0] for s in steps]
    n = len(warm.SHAPES) * 2
    # the model's dtype, the shape a first world meets first, through the batch kernel: step 0,
    # the one process 0 starts on
    assert steps[0] == ("batch", "bfloat16", 0)
    assert kinds[:n] == ["batch"] * n and kinds[n:2 * n] == ["one"] * n and steps[2 * n:] == [("gemm", spec)]
    # every (kernel, dtype, shape) once
    assert len(set(steps[:2 * n])) == 2 * n
    every = {(d, i) for d in ("bfloat16", "float32") for i in range(len(warm.SHAPES))}
    assert {(s[1], s[2]) for s in steps[:n]} == every
    # with the fix on from the first pass its GEMMs lead instead; without it, none
    assert warm.plan(["bfloat16"], spec, gemm_first=True)[0] == ("gemm", spec)
    assert all(s[0] != "gemm" for s in warm.plan(["bfloat16"]))


def test_gemm_spec_follows_the_run():
    base = dict(model="llama-1b", degrees=(1, 2), dtype="bfloat16", batch_size=1, seq_len=2048)
    spec, first = warm.gemm_spec(CompareConfig.of(**base))  # the default flow: confirmation with the fix
    assert spec == ("llama-1b", "stock", "bfloat16", 1, 2048, 2, True, True) and first is False
    # TP=1,2,4: four tree groups, the reference holds all four; --tree-groups 8: fused, not per group
    assert warm.gemm_spec(CompareConfig.of(**{**base, "degrees": (1, 2, 4)}))[0][5:7] == (4, True)
    assert warm.gemm_spec(CompareConfig.of(**base, tree_groups=8))[0][5:7] == (8, False)
    assert warm.gemm_spec(CompareConfig.of(**base, confirm=False)) == (None, False)
    other = CompareConfig.of(**base, fixes=("invariant-attention",), fix_mode="explicit")
    assert warm.gemm_spec(other) == (None, False)
    spec, first = warm.gemm_spec(CompareConfig.of(**base, fixes=("tp-invariant-linear",), fix_mode="explicit"))
    assert spec is not None and first is True
    assert warm.gemm_spec(CompareConfig.of(**{**base, "model": "py:x.py:f"})) == (None, False)


def test_gemm_shapes_are_the_linears_the_fix_wraps():
    p = PRESETS["llama-1b"]
    d, kv, f, v = p["dim"], p["n_kv_heads"] * p["dim"] // p["n_heads"], p["ffn_dim"], p["vocab_size"]
    assert warm.linear_shapes("llama-1b") == sorted(
        {("colwise", d, d), ("colwise", d, kv), ("colwise", d, f), ("colwise", d, v), ("rowwise", d, d),
         ("rowwise", f, d)})
    # the "stable" plan's out-projections are column-parallel over their output, gathered
    assert ("colwise-gathered", d, d) in warm.linear_shapes("llama-1b", "stable")


def test_gemm_warmup_runs_the_fix_gemms(monkeypatch):
    """The warm-up drives every Linear the fix wraps through the fix's own Functions, forward and
    backward, on the 16-bit tensor-core branch (forced here: the CPU has no Triton GEMM; the
    GEMMs are recorded and done by torch), under the run's groups, one GEMM per group."""
    from tpdiag.kernels import grouped_linear, invariant_gemm, tree

    calls = []

    def fake_mm(a, b, *, out_dtype=None, config=None, acc=None):
        calls.append((tuple(a.shape), tuple(b.shape), a.stride(1) != 1, b.stride(1) != 1, out_dtype,
                      tree.n_groups(), tree.gemm_per_group()))
        return (a.float() @ b.float()).to(out_dtype or a.dtype)

    monkeypatch.setattr(invariant_gemm, "triton_mm", fake_mm)
    monkeypatch.setattr(grouped_linear, "_tensor_cores", lambda x, w: True)
    ran = warm.warm_gemms(("tiny-llama", "stock", "bfloat16", 1, 4, 2, True, True), torch.device("cpu"))
    assert ran == len(warm.linear_shapes("tiny-llama")) == 5  # the LM head is w1's shape
    assert {c[5:] for c in calls} == {(2, True)}
    # tiny-llama: dim 256, kv 128, ffn 512, vocab 512; M = 1 x 4 tokens
    fp32 = torch.float32
    # rowwise wo / w2 forward: one fp32 GEMM per K group of the reference's 2, B = w.t() (transposed)
    for k in (256, 512):
        assert calls.count(((4, k // 2), (k // 2, 256), False, True, fp32, 2, True)) == 2
        # backward: dx = g @ w, dw = g.t() @ x (A transposed), 16-bit out
        assert ((4, 256), (256, k), False, False, None, 2, True) in calls
        assert ((256, 4), (4, k), True, False, None, 2, True) in calls
    # colwise dgrad: per N group, fp32 out (the forward and wgrad are the stock GEMM under this fix)
    for n in (128, 256, 512):
        assert calls.count(((4, n // 2), (n // 2, 256), False, False, fp32, 2, True)) >= 2
    # the warm-up is off the Triton path on the CPU without the forced branch: it still runs
    monkeypatch.undo()
    assert warm.warm_gemms(("tiny-llama", "stock", "float32", 1, 4, 2, True, False), torch.device("cpu")) == 5
