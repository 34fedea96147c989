"""Fail closed on this session's grad-hook evidence (red team hred16). A grad hook the plan dropped is a
BUG named from world.json (hooks_dropped at TP=N, hook_effect at TP=1: diff/dropped_hooks.py), not from
a bound - from TP=N's own inputs its unhooked grad is exact, so diff.csv has the grad within its bound
and the check of the findings against diff.csv could not see the finding deleted. On main,
grad_hook_plan.py:hook_mixed (w1's clip dropped, the head's halving kept) with the finding cut from
summary.json and ops/summary.json passed `gate --allow rounding` (exit 0), and so did the same with
hooks_dropped also cut from TP=2's world.json. Now the gate re-derives the finding from the worlds'
world.json (dropped_hooks.unnamed) and holds the worlds' hooked parameters to one set
(dropped_hooks.census: TP > 1 worlds list the hooks the plan kept, hooks_kept): both exit 2.
"""
import json

import pytest

from conftest import copied_run, gate_allowing_rounding, json_edit, planted_run
from tpdiag.records.causes import EXIT_BUG

GRAD = "s0/backward/w1/param_grad#0/weight"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return planted_run(tmp_path_factory, "grad_hook_plan", "hook_mixed", "--tp", "1,2", name="hooks")[0]


@pytest.fixture()
def run(mixed, tmp_path):
    return copied_run(mixed, tmp_path)


_edit = json_edit


def _cut_finding(s):
    for d in s["degrees"].values():
        d["findings"] = [f for f in d["findings"] if f.get("key") != GRAD]
        d.pop("hooks_dropped", None)
        d["class"] = "rounding"
    s["class"] = "rounding"


_gate = gate_allowing_rounding


def test_the_honest_run_is_a_bug_with_the_kept_hook_listed(mixed):
    w1, w2 = (json.loads((mixed / f"tp{n}" / "world.json").read_text()) for n in (1, 2))
    assert w1["hook_effect"] == {"head.weight": True, "w1.weight": True}, w1.get("hook_effect")
    assert (w2["hooks_dropped"], w2["hooks_kept"]) == ({"w1.weight": ["clip"]}, ["head.weight"]), w2
    res = _gate(mixed)
    assert res.exit_code == EXIT_BUG, res.lines()


@pytest.mark.parametrize("worlds", [(), ("tp2", "ops/tp2")], ids=["summaries", "summaries+world"])
def test_the_dropped_hooks_finding_cut_is_inconclusive(run, worlds):
    for f in ("summary.json", "ops/summary.json"):
        _edit(run / f, _cut_finding)
    for w in worlds:
        _edit(run / w / "world.json", lambda w: w.pop("hooks_dropped"))
    res = _gate(run)
    words = "hooks_dropped" if not worlds else "TP=2's neither as kept nor dropped"
    assert res.exit_code == 2 and words in res.problems[0], res.lines()


def test_a_kept_hook_cut_from_world_json_is_inconclusive(run):
    _edit(run / "tp2" / "world.json", lambda w: w.pop("hooks_kept"))
    res = _gate(run)
    assert res.exit_code == 2 and "grad hooks on head.weight" in res.problems[0], res.lines()


def test_hook_effect_edited_to_an_observer_is_inconclusive(run):
    """hook_effect false says the dropped clip changed no grad at TP=1, so TP=2's unclipped grad would be
    TP=1's up to rounding; it is 3.8 times its norm away. On main, hook_effect set false in TP=1's and the
    second pass's world.json with the finding cut from both summaries passed `gate --allow rounding`
    (exit 0, red team hred16); now the claim is held to the grads (dropped_hooks._not_idle)."""
    def idle(s):
        _cut_finding(s)
        for d in s["degrees"].values():
            d["hooks_idle"] = ["w1.weight"]

    for f in ("summary.json", "ops/summary.json"):
        _edit(run / f, idle)
    for w in ("tp1", "ops/tp1"):
        _edit(run / w / "world.json", lambda w: w["hook_effect"].update({"w1.weight": False}))
    res = _gate(run)
    words = "hook_effect calls the grad hook(s) clip on w1.weight an observer"
    assert res.exit_code == 2 and words in res.problems[0], res.lines()


def test_every_hook_field_cut_from_every_world_is_inconclusive(run):
    """hook_effect, hooks_dropped and hooks_kept cut from all four worlds' world.json with the finding cut
    from both summaries: nothing of the worlds names a hook any more. On main this passed `gate --allow
    rounding`, exit 0 (red team hred16); the unclipped grad moved 3.8 times its norm, so a degree naming
    only rounding with no finding there is an edit (diff/moved_records.cut)."""
    for f in ("summary.json", "ops/summary.json"):
        _edit(run / f, _cut_finding)
    for w in ("tp1", "tp2", "ops/tp1", "ops/tp2"):
        _edit(run / w / "world.json",
              lambda w: [w.pop(k, None) for k in ("hook_effect", "hooks_dropped", "hooks_kept")])
    res = _gate(run)
    assert res.exit_code == 2 and f"no finding at {GRAD}, but that record moved" in res.problems[0], res.lines()


def test_census_on_hand_made_worlds():
    from tpdiag.diff.dropped_hooks import census

    rows = [{"kind": "param_grad", "module": m, "name": "weight"} for m in ("a", "b")]
    ref = {"hook_effect": {"a.weight": True, "b.weight": False}}
    assert census("2", ref, {"hooks_dropped": {"a.weight": ["f"]}, "hooks_kept": ["b.weight"]}, rows) is None
    assert census("2", ref, dict(ref), rows) is None  # a micro-batch configuration: TP=1 both sides
    assert census("2", {}, {}, rows) is None
    # a hand-written TP's own hooks at TP > 1 (two_paths.py): more at TP=N is no edit
    assert census("2", {}, {"hooks_kept": ["a.weight"]}, rows) is None
    assert "b.weight" in census("2", ref, {"hooks_dropped": {"a.weight": ["f"]}}, rows)
    assert census("2", ref, {"hooks_dropped": {"a.weight": ["f"]}}, rows[:1]) is None  # b not at TP=2
