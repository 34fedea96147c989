"""A grad hook the TP plan drops (tests/models/planted/grad_hook_plan.py, helper hhook16): a hook the
user registers on a weight before the plan is applied lives on the old Parameter, and
parallelize_module replaces it - the hook runs at TP=1 and not at TP=2. On the old code the clip
(`hook_build`) read rounding only (gate 1: from TP=2's own inputs its unclipped grad is exact) and the
halving (`hook_init`) a BUG "a loss or grad divided or multiplied by another count"; now both are a
BUG at the weight's grad naming the hook, while the twin that registers the hook after the plan and an
observer hook that changes no grad (dropped too) read rounding."""
import pytest

from conftest import compare_planted

CASES = {c: ("grad_hook_plan", c, ("--tp", "1,2")) for c in ("hook_init", "hook_build", "hook_after", "hook_logger")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # hook_build's and hook_after's runs are test_failclosed_order's and test_failclosed_selfcheck's
    return compare_planted(tmp_path_factory, CASES, shared=("hook_build", "hook_after"))


def _bug(s, module):
    d = s["degrees"]["2"]
    f = d["findings"][0]
    assert s["class"] == "bug" and (f["module"], f["kind"], f["name"], f["cause"]) == (module, "param_grad", "weight", "sharding-bug"), d
    return d, f


@pytest.mark.parametrize("case,module,hook", [("hook_build", "w1", "clip"), ("hook_init", "w2", "halve")])
def test_a_hook_the_plan_dropped_is_a_bug_at_the_weight(runs, case, module, hook):
    s, stdout, gate = runs[case]
    d, f = _bug(s, module)
    assert d["hooks_dropped"] == {f"{module}.weight": [hook]}, d.get("hooks_dropped")
    assert f"the grad hook {hook} registered on {module}.weight before the plan" in f["why"], f["why"]
    assert "parallelize_module replaced the parameter" in stdout and gate == 4, (gate, stdout)


def test_the_hook_registered_after_the_plan_holds(runs):
    s, stdout, gate = runs["hook_after"]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and "hooks_dropped" not in d and gate == 1, (gate, d)


def test_an_observer_hook_dropped_is_said_not_a_bug(runs):
    s, stdout, gate = runs["hook_logger"]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and gate == 1, (gate, d)
    assert d["hooks_dropped"] == {"w2.weight": ["log_norm"]} and d["hooks_idle"] == ["w2.weight"], d
    assert "the plan dropped the user's grad hooks on w2.weight (log_norm)" in stdout, stdout


def test_dropped_hooks_by_identity_and_watch():
    import torch
    from torch import nn

    from tpdiag.models.grad_hooks import dropped_hooks, grad_hooks, watch

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    scale = lambda g: g * 2  # noqa: E731
    m[0].weight.register_hook(scale)
    m[1].weight.register_post_accumulate_grad_hook(lambda p: None)
    before = grad_hooks(m)
    m[0].register_parameter("weight", nn.Parameter(m[0].weight.detach().clone()))  # as a style replaces it
    lost = dropped_hooks(before, m)
    assert list(lost) == ["0.weight"] and lost["0.weight"][0].startswith("test_dropped_hooks_by_identity_and_watch.<locals>.<lambda> (")
    m[0].weight.register_hook(scale)  # the same hook again on the new parameter: kept
    assert dropped_hooks(before, m) == {}
    effect = {}
    watch(m, effect)
    m(torch.ones(1, 4)).sum().backward()
    assert effect == {"0.weight": True, "1.weight": False}, effect


def test_the_float64_re_execution_leaves_no_hook_on_the_real_weight():
    """hook_after's forward registers its hook on the weight at its first call; the float64
    re-execution runs that forward again from the state before the call (base/user_state.py), on
    the module itself - its registration landed on the REAL weight, and the step's grad went through
    halve once more per re-execution (the second pass "computed another step": class unknown, with
    the root re-executed). probes/float64_state.tensor_hooks / drop_added_hooks take it back."""
    import torch
    from torch import nn

    from tpdiag.probes.float64 import module_oracle, snapshot
    from tpdiag.probes.float64_state import buffers_before

    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.later = True

        def forward(self, x):
            if self.later:
                self.lin.weight.register_hook(lambda g: g * 0.5)
                self.later = False
            return self.lin(x)

    m, x = Late(), torch.randn(2, 4)
    before, args = buffers_before(m), snapshot((x,))
    m(x).sum().backward()  # the real call: one hook
    g1 = m.lin.weight.grad.clone()
    assert len(m.lin.weight._backward_hooks) == 1
    out, notes = module_oracle(m, args, {}, before)
    assert out is not None and out.dtype == torch.float64, notes
    assert len(m.lin.weight._backward_hooks) == 1 and m.later is False  # nothing left behind
    m.lin.weight.grad = None
    m(x).sum().backward()
    assert torch.equal(m.lin.weight.grad, g1)  # the next step's grad halved once, as the user's


def test_a_hook_that_steps_the_weight_in_the_backward_is_an_effect():
    """An optimizer step in a post-accumulate-grad hook that leaves the grad in place (helper hreview16):
    watch read it as an observer (effect False), so a plan that dropped it would be said, not named."""
    import torch
    from torch import nn

    from tpdiag.models.grad_hooks import watch

    def sgd_in_backward(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)

    def looks(p):
        float(p.grad.norm())

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[0].weight.register_post_accumulate_grad_hook(sgd_in_backward)
    m[1].weight.register_post_accumulate_grad_hook(looks)
    effect: dict = {}
    watch(m, effect)
    m(torch.randn(2, 4)).sum().backward()
    assert effect == {"0.weight": True, "1.weight": False}, effect
