"""A forward hook the user's forward registers on its first call (tests/models/planted/fwd_hook_late.py):
tpdiag's float64 re-execution runs the module's forward again from the state before the call, so it
registered the hook a second time on the REAL module, and from the second step on w2's output was
damped twice - the float64 pass "computed another step than the first pass" and a correct model read
`not judged (cause unknown)` at --steps 3. The re-execution now takes back every hook it registered
(module forward/backward hooks, tensor grad hooks, torch's global module hooks)."""
import pytest
import torch
from torch import nn

from conftest import compare_planted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, {"damped": ("fwd_hook_late", "damped", ("--tp", "1,2", "--steps", "3"))})


def test_a_lazily_registered_forward_hook_reads_rounding_at_three_steps(runs):
    s, stdout, gate = runs["damped"]
    assert s["class"] == "rounding" and gate == 1, (gate, stdout[-2000:])
    assert "computed another step" not in stdout, stdout[-2000:]


def test_hooks_registered_inside_the_window_are_taken_back():
    from tpdiag.probes.float64_state import drop_added_hooks, tensor_hooks

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    kept_hook = m[1].register_forward_hook(lambda mod, a, o: o)
    mods = list(m.modules())
    before = tensor_hooks(mods)
    m[1].register_forward_hook(lambda mod, a, o: o * 0.5)
    m[0].register_forward_pre_hook(lambda mod, a: None)
    m[0].weight.register_hook(lambda g: g * 2)
    glob = nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)
    try:
        drop_added_hooks(before)
        assert list(m[1]._forward_hooks) == [kept_hook.id] and not m[0]._forward_pre_hooks
        assert not m[0].weight._backward_hooks and not nn.modules.module._global_forward_hooks
        x = torch.randn(2, 4)
        assert torch.equal(m(x), m[1](m[0](x)))
    finally:
        glob.remove()
