"""The float64 oracle never changes what the probed model computes (issue 57's root cause).

Its re-execution of a module and of its backward ran inside the step's gradient-accumulation
window (kernels/grad_carry.py, open whenever a carry fix is on): a parent module's children
registered their real weights' carry sites again and the oracle's backward added its float64
weight grads into the step's carries - so into .grad, a 4x wrong step on a planted attention
model with --judge-downstream. Checked here in process (with a negative control) and end to end:
a world whose every module is re-executed in float64 computes exactly the bits of one without.
"""
import json
import os

import torch
from torch import nn

from tpdiag.kernels import grad_carry
from tpdiag.kernels.carry_functions import CarryLinear
from tpdiag.probes.float64 import module_oracle, module_oracle_grads, snapshot


class Carried(nn.Linear):
    """A Linear whose weight grad goes into the open window's carry (as the fixes' Functions do)."""

    def forward(self, x):
        return CarryLinear.apply(x, self.weight, grad_carry.site(self.weight, "w"))


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Carried(8, 8, bias=False), Carried(8, 8, bias=False)
        self.cache = None

    def forward(self, x):
        self.cache = x.sum()  # state a re-execution must not leave behind (a lazily built cache)
        return self.b(torch.tanh(self.a(x)))


def _oracle(m, x, y):
    cache = m.cache
    out64, notes = module_oracle(m, *snapshot(((x,), {})))
    grads, notes = module_oracle_grads(m, *snapshot(((x,), {})), torch.ones_like(y))
    assert out64 is not None and grads is not None and "in0" in grads, notes
    assert m.cache is cache  # a float64 run's cache is not left behind: the real one is back


def _naive(m, x, y):
    """The negative control: the float64 backward as it ran before the fix - the module's real
    parameters read through the mode, inside the open window."""
    from tpdiag.probes.float64_mode import Float64Mode

    x64 = x.detach().double().requires_grad_()
    with torch.enable_grad(), Float64Mode(set()):
        torch.autograd.grad(m(x64), [x64], torch.ones_like(y).double())


def _step(oracle=None):
    torch.manual_seed(0)
    m, x = Parent(), torch.randn(16, 8)
    with grad_carry.window(m):
        y = m(x)
        if oracle is not None:  # where the oracle's hooks run it: after the forward, before the backward
            oracle(m, x, y)
        y.square().sum().backward()
    return [p.grad.clone() for p in m.parameters()]


def test_the_oracle_inside_a_carry_window_leaves_the_step_bitwise():
    plain, probed = _step(), _step(_oracle)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))


def test_negative_control_a_float64_backward_in_the_window_changes_the_grads():
    plain, probed = _step(), _step(_naive)
    assert not all(torch.equal(a, b) for a, b in zip(plain, probed))


def test_a_world_with_every_module_reexecuted_computes_the_same_bits(tmp_path):
    """Real gloo worlds, tiny-llama with the carry fixes on: the reference re-executes EVERY
    module (and its backward) in float64; its step's fingerprint (logits, loss, grad norm, every
    updated parameter) and every record it shares with an unprobed-by-oracle run are bitwise."""
    from tpdiag.config import CompareConfig
    from tpdiag.models import tiny_llama
    from tpdiag.records.store import RecordSet
    from tpdiag.runner.compare import compare_pass

    model = tiny_llama.build("tiny-llama", n_layers=1)
    names = tuple(n or "model" for n, _ in model.named_modules())
    fixes = ("tp-invariant-linear", "invariant-gemm", "invariant-norm-grad")
    base = CompareConfig.of(model="tiny-llama", degrees=(1, 2), device="cpu", fixes=fixes, fix_mode="explicit",
                            confirm=False, baseline=False, layers=1)
    compare_pass(base.with_(out=str(tmp_path / "plain")))
    compare_pass(base.with_(out=str(tmp_path / "oracle"), oracle=names))
    fp = [json.loads((tmp_path / d / "tp1" / "world.json").read_text())["fingerprint"] for d in ("plain", "oracle")]
    assert fp[0] and fp[0] == fp[1], fp
    a, b = (RecordSet(str(tmp_path / d / "tp1")) for d in ("plain", "oracle"))
    oracles = [k for k, m in b.by_key.items() if m["kind"] == "oracle"]
    assert any("/backward/layers.0/oracle" in k for k in oracles), oracles[:20]  # a parent's backward ran
    shared = [k for k in a.by_key if k in b.by_key]
    assert len(shared) == len(a.by_key) > 50
    assert [k for k in shared if a.by_key[k]["hash"] != b.by_key[k]["hash"]] == []
