"""Fail closed on a world whose probe self-check failed (red team hred17). Each world runs its step once
unprobed and compares it with the probed run (world.json probe_selfcheck, runner/worker.py); where they
differ the probes changed the numerics or the step is not deterministic, its records are no evidence,
and compare calls the configuration failed - a status the gate fails closed on. That status was
summary.json's word alone: a correct run (grad_hook_plan.py:hook_after) whose TP=2 world.json says the
self-check failed, under a summary.json that does not say so (edited back to divergent), passed
`gate --allow rounding` on main, exit 0. Now the gate reads the worlds' own word (diff/recheck.check_selfcheck)
with analyse_degree's whole rule: a second world at the reference's degree (`--tp 1,1`) whose records differ
stays a finding, divergent and not reproducible (hred17's first check lacked that exception and failed the
honest pair of tests/test_diagnosis.py::test_same_degree_pair_names_a_nondeterministic_backward_at_its_op).
"""
import shutil

import pytest

from conftest import json_edit, planted_shared
from tpdiag.gate import evaluate, load_policy
from tpdiag.gate.policy import with_allowed


@pytest.fixture(scope="module")
def after(tmp_path_factory):
    return planted_shared(tmp_path_factory, "grad_hook_plan", "hook_after", "--tp", "1,2")[0]  # test_grad_hook_plan's


@pytest.fixture()
def run(after, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(after, dst, symlinks=True)
    return dst


def _gate(run):
    return evaluate(str(run), with_allowed(load_policy(None), "rounding"))


def test_the_honest_run_passes_with_rounding_allowed(after):
    assert _gate(after).exit_code == 0


@pytest.mark.parametrize("world", ["tp2", "tp1"])
def test_a_failed_self_check_the_summary_does_not_say_is_inconclusive(run, world):
    def failed(w):
        w["probe_selfcheck"] = {"equal": False, "checked": 20, "first_mismatch": "s0/forward/w2/out#0/0"}

    json_edit(run / world / "world.json", failed)
    res = _gate(run)
    who = "TP=2" if world == "tp2" else "the reference"
    assert res.exit_code == 2 and f"{who}'s world.json says its probed and unprobed runs differ" in res.problems[0], \
        res.lines()
