"""A user module that writes Python state outside its tensors (tests/models/planted/global_state.py,
helper hhook16): a warm-up scale counting its calls in a module-level global, or in a dict the module
holds. tpdiag runs the user's code more often than the user does - the float64 re-execution runs the
forward again, the self-check runs the step twice - and each extra run advanced the counter for the
real run's next call. On the old code `global_count` read inconclusive (gate 2: "the probed and the
unprobed run of the reference differ") and `dict_count` not judged ("the float64 pass computed another
step than the first pass", class unknown); now both read rounding with the re-execution within
rounding of each side, run from the counter the real call saw and leaving it as the real calls left it
(base/user_state.py). Restoring the state only after the re-execution read rounding by luck: it ran
from the advanced counter, 0.5 (relative) from both sides alike - hence the distance checked below."""
import importlib.util
import os

import pytest
import torch

from conftest import compare_planted

CASES = {c: ("global_state", c, ("--tp", "1,2", "--steps", "2")) for c in ("global_count", "dict_count")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_a_counter_the_user_keeps_reads_rounding(runs, case):
    s, stdout, gate = runs[case]
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert s["class"] == "rounding" and gate == 1, (gate, stdout)
    assert (fd["module"], fd["cause"]) == ("down", "row-parallel-reduction"), fd
    # the re-execution computed the same step as the real call: near both sides, not 0.5 from both
    o = fd["oracle"]
    assert max(o["ref_err"], o["err"]) < 1e-5, o
    assert "downstream_unjudged" not in d and d["status"] == "divergent", d


def _planted():
    path = os.path.join(os.path.dirname(__file__), "models", "planted", "global_state.py")
    spec = importlib.util.spec_from_file_location("global_state_t", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("cls", ["WarmGlobal", "WarmDict"])
def test_the_reexecution_runs_from_the_counter_before_the_call_and_leaves_it(cls):
    from tpdiag.probes.float64 import buffers_before, module_oracle, snapshot

    g = _planted()
    torch.manual_seed(0)
    mod = getattr(g, cls)(8, 4, bias=False)
    count = (lambda: g.CALLS) if cls == "WarmGlobal" else (lambda: mod.seen["calls"])
    x = torch.randn(3, 8)
    mod(x)  # the first call: scale 1/4
    snap, bufs = snapshot(((x,), {})), buffers_before(mod)
    y = mod(x)  # the real second call: scale 2/4
    out, notes = module_oracle(mod, *snap, buffers=bufs)
    assert "why" not in notes, notes
    assert count() == 2  # the re-execution advanced nothing for the next real call
    exact = (x.double() @ mod.weight.double().t()) * (2 / g.WARMUP)
    # from the counter the real call saw (the old code: the next one, 3/4)
    assert float((out - exact).norm() / exact.norm()) < 1e-12, (out - exact).abs().max()
    assert float((y.detach().double() - exact).norm() / exact.norm()) < 1e-6


def test_put_back_restores_names_and_containers_in_place():
    from tpdiag.base.user_state import put_back, take

    g = _planted()
    mod = g.WarmDict(4, 4)
    mod.lst = [1]
    seen, lst = mod.seen, mod.lst
    kept = take([g.WarmGlobal(4, 4), mod])
    g.CALLS, mod.seen["calls"], mod.new = 7, 5, 1
    mod.lst.append(2)
    put_back(kept)
    assert g.CALLS == 0 and mod.seen is seen and seen == {"calls": 0} and mod.lst is lst and lst == [1]
    assert not hasattr(mod, "new")
