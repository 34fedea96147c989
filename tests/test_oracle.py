"""The float64 oracle (probes/float64.py) and its verdict (diff/oracle.py), in process.

What is measured here is what diff/oracle.py's docstring quotes: pure reorderings of the same
function (sums split over N = 2..8 ranks, distributed norms and softmaxes, in fp32 and bf16)
stay far inside the threshold, and planted mistakes land far beyond it.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpdiag.diff.oracle import judge
from tpdiag.probes.float64 import module_oracle, op_oracle, snapshot


class Casts(nn.Module):
    """Code that picks its own dtypes: the oracle must keep every step in float64."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        h = (x.float() @ self.w.t()).to(torch.bfloat16)
        z = torch.zeros(h.shape, dtype=torch.float32)
        return torch.softmax(h.float() + z, dim=-1, dtype=torch.float32).to(x.dtype)


def test_module_oracle_runs_every_op_in_float64():
    torch.manual_seed(0)
    m, x = Casts(), torch.randn(4, 16, dtype=torch.bfloat16)
    out, notes = module_oracle(m, *snapshot(((x,), {})))
    assert out.dtype == torch.float64 and notes == {}
    exact = torch.softmax(x.double() @ m.w.double().t(), dim=-1)
    assert torch.allclose(out, exact, rtol=0, atol=1e-12)
    # the module's own run rounds to bf16 on the way: far from the float64 value
    assert (m(x).double() - exact).abs().max() > 1e-4


class Noisy(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1.0)
        return x * 2


def test_random_and_stateful_modules_are_refused_with_a_reason_and_no_side_effect():
    x = torch.randn(3)
    state = torch.get_rng_state()
    out, notes = module_oracle(Noisy(), (x,), {})
    assert out is None and "random" in notes["why"] and "bernoulli" in notes["why"]
    assert torch.equal(torch.get_rng_state(), state)  # refused before drawing anything
    w = Writes()
    out, notes = module_oracle(w, (x,), {})
    assert out is None and "writes state" in notes["why"]
    assert torch.equal(w.count, torch.zeros(3))


def test_discrete_choices_are_noted():
    class Router(nn.Module):
        def forward(self, x):
            return x.gather(-1, x.topk(2, dim=-1).indices)

    out, notes = module_oracle(Router(), (torch.randn(4, 8),), {})
    assert out.dtype == torch.float64 and notes["discrete"] == ["aten::topk"]


def test_op_oracle_reexecutes_one_aten_op():
    a, b = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(32, 4, dtype=torch.bfloat16)
    out, why = op_oracle(torch.ops.aten.mm.default, (a, b), {})
    assert why is None and torch.equal(out, a.double() @ b.double())
    out, why = op_oracle(torch.ops.aten.add_.Tensor, (a, a), {})
    assert out is None and "in place" in why


def _split_sum(x, w, n, order):
    """x @ w^T with K split into n rank partials, each rounded to x's dtype, summed in `order`."""
    k = x.shape[-1] // n
    parts = [(x[..., r * k:(r + 1) * k].float() @ w[:, r * k:(r + 1) * k].float().t()).to(x.dtype)
             for r in range(n)]
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for r in order(n):
        acc = acc + parts[r].float()
    return acc.to(x.dtype)


def _dist_layer_norm(y, n):
    """LayerNorm with statistics from n column shards' partial sums (a correct TP norm)."""
    c = y.shape[-1] // n
    sh = [y[..., r * c:(r + 1) * c].float() for r in range(n)]
    mean = sum(s.sum(-1, keepdim=True) for s in reversed(sh)) / y.shape[-1]
    var = sum(((s - mean) ** 2).sum(-1, keepdim=True) for s in reversed(sh)) / y.shape[-1]
    return ((y.float() - mean) * torch.rsqrt(var + 1e-5)).to(y.dtype)


def test_pure_reorderings_stay_far_inside_the_threshold_and_planted_mistakes_far_beyond():
    torch.manual_seed(1)
    worst, least_bug = 0.0, float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 512).to(dtype)
        w = (torch.randn(128, 512) / 512 ** 0.5).to(dtype)
        exact = x.double() @ w.double().t()
        ref = (x.float() @ w.float().t()).to(dtype)
        for n in (2, 4, 8):
            for order in (lambda n: range(n), lambda n: reversed(range(n)),
                          lambda n: [*range(0, n, 2), *range(1, n, 2)]):
                v = judge(ref, _split_sum(x, w, n, order), exact)
                assert not v["far"], (dtype, n, v)
                worst = max(worst, v["ratio"])
            y = (torch.randn(64, 256) * 3 + 1).to(dtype)
            ln_exact = F.layer_norm(y.double(), (256,))
            v = judge(F.layer_norm(y.float(), (256,)).to(dtype), _dist_layer_norm(y, n), ln_exact)
            assert not v["far"], (dtype, n, v)
            worst = max(worst, v["ratio"])
            # the mistakes: a norm over a shard, the bias added n times, a reversed gather
            shard = torch.cat([F.layer_norm(p.float(), p.shape[-1:]) for p in y.chunk(n, -1)], -1).to(dtype)
            b = torch.randn(128).to(dtype)
            bias_n = (ref.float() + n * b.float()).to(dtype)
            rev = torch.cat(ref.chunk(n, -1)[::-1], -1)
            for bad, ex, good in ((shard, ln_exact, F.layer_norm(y.float(), (256,)).to(dtype)),
                                  (bias_n, exact + b.double(), (ref.float() + b.float()).to(dtype)),
                                  (rev, exact, ref)):
                v = judge(good, bad, ex)
                assert v["far"], (dtype, n, v)
                least_bug = min(least_bug, v["ratio"])
    # reorderings (8192 outputs: A = 3.2) used under half of the threshold; each mistake was
    # > 1.5x beyond it
    assert worst < 0.5 and least_bug > 1.5, (worst, least_bug)


def test_the_threshold_needs_its_margin():
    """Negative control: without the margin (A = 1) the same reorderings would be called far."""
    torch.manual_seed(2)
    x = torch.randn(64, 512).to(torch.bfloat16)
    w = (torch.randn(128, 512) / 512 ** 0.5).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    ref = (x.float() @ w.float().t()).to(torch.bfloat16)
    v = judge(ref, _split_sum(x, w, 8, lambda n: reversed(range(n))), exact)
    assert not v["far"] and v["ratio"] * v["margin"] > 0.5, v  # within a small factor of the level


def test_module_backward_in_float64_gives_weight_and_input_grads():
    from tpdiag.probes.float64 import module_oracle_grads

    torch.manual_seed(3)
    m = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    g = torch.randn(4, 8, dtype=torch.bfloat16)
    grads, notes = module_oracle_grads(m, *snapshot(((x,), {})), g)
    assert notes == {} and all(t.dtype == torch.float64 for t in grads.values())
    assert torch.equal(grads["weight"], g.double().t() @ x.double())
    assert torch.equal(grads["bias"], g.double().sum(0))
    assert torch.allclose(grads["in0"], g.double() @ m.weight.double(), rtol=0, atol=1e-12)
    assert m.weight.grad is None  # the real parameter is untouched


def test_grouped_mm_is_reexecuted_group_by_group_in_float64():
    """MoE experts in transformers 5.24 run through aten::_grouped_mm, whose kernel refuses float64
    (the negative control below): the oracle computes it group by group in float64, so an experts
    module gets a verdict (tests/test_hf_plans.py)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g), torch.randn(3, 4, 8, generator=g)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # group 1 has no rows

    class Experts(nn.Module):
        def forward(self, x):
            return torch._grouped_mm(x, b, offs=offs)

    with pytest.raises(RuntimeError, match="Double"):
        torch._grouped_mm(a.double(), b.double(), offs=offs)
    out, notes = module_oracle(Experts(), *snapshot(((a,), {})))
    assert out is not None and out.dtype == torch.float64, notes
    want = torch.cat([a[:2].double() @ b[0].double(), a[2:].double() @ b[2].double()])
    assert torch.equal(out, want)
    assert torch.allclose(out.float(), torch._grouped_mm(a, b, offs=offs), atol=1e-5)



_NORMED = """
import warnings, torch
from torch import nn
from tpdiag.probes.float64 import module_oracle, snapshot
warnings.simplefilter("always")
torch.manual_seed(0)
m = nn.Sequential(nn.RMSNorm(8), nn.Linear(8, 16, bias=False))
x = torch.randn(2, 3, 8)
if MODE == "oracle":
    out, notes = module_oracle(m, *snapshot(((x,), {})))
    x64 = x.double()
    ref = nn.functional.linear(nn.functional.rms_norm(x64, (8,), m[0].weight.double()), m[1].weight.double())
    print("dtype", out.dtype, "notes", notes, "close", torch.allclose(out, ref, rtol=1e-13, atol=0))
else:  # what the oracle's first op does unguarded: a float64 input beside the float32 weight
    with torch.no_grad():
        nn.functional.rms_norm(x.double(), (8,), m[0].weight)
"""


@pytest.mark.parametrize("mode", ["oracle", "control"])
def test_module_oracle_keeps_torch_dtype_warnings_out_of_the_output(mode):
    """Before: `tpdiag compare` of a py: model with torch's nn.RMSNorm in a block printed torch's
    'Mismatch dtype between input and weight ... Cannot dispatch to fused implementation' above
    the verdict (the oracle hands rms_norm a float64 input while the weight is still the float32
    parameter; the unfused ops it falls back to run in float64). torch warns once per process, so
    each side runs in a fresh interpreter; the control shows the warning is there to be hidden."""
    import os
    import subprocess
    import sys

    import tpdiag

    root = os.path.dirname(os.path.dirname(os.path.abspath(tpdiag.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", f"MODE = {mode!r}\n" + _NORMED], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    if mode == "oracle":
        assert "Mismatch dtype" not in r.stderr, r.stderr
        assert r.stdout.split() == ["dtype", "torch.float64", "notes", "{}", "close", "True"], r.stdout
    else:
        assert "Mismatch dtype between input and weight" in r.stderr, r.stderr
