"""A user's OWN torch.optim.Optimizer subclass in a captured TP loop (tests/user_own_optim.py: Adafactor,
Muon with a bf16 Newton-Schulz, momentum SGD with decoupled decay; DTensor plan, two steps, gloo
worlds), then `tpdiag diff` and `tpdiag gate` as a user runs them.

Main at d179534 read every one of them `not judged` ("stepped by __main__.Muon, which tpdiag does not
re-run", gate 1 even with --allow rounding): the correct ones as the bugs. Now the capture re-executes
the optimizer's own step() in float64 on the whole (gathered) tensors (probes/optim_shadow.py) and the
diff judges each side against its own re-execution (diff/optim_own.py): the correct Adafactor, Muon (which
gathers each sharded grad before its Newton-Schulz) and SGD read rounding only; Muon's Newton-Schulz
on each rank's shard and a decay applied twice on rank 1 read BUG at the optimizer step of `up`.

Torch's own optimizers without an update rule in tpdiag (RMSprop; torch's Muon beside AdamW) read
"not judged" at main 958380d (gate 1: the capture re-executed only a user's own class); they are
re-executed as a user's own now and read rounding."""
import json
import shutil

import pytest
import torch

from conftest import run_cli
from user_worlds import capture_worlds

TORCH_MUON = hasattr(torch.optim, "Muon")


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("own_opt"), "user_own_optim", "steps",
                          ((1, "adafactor"), (2, "adafactor"), (1, "muon"), (2, "muon"), (2, "muon_shard"),
                           (1, "sgdw"), (2, "sgdw"), (2, "sgdw_rank"), (1, "rmsprop"), (2, "rmsprop"))
                          + (((1, "torch_muon"), (2, "torch_muon")) if TORCH_MUON else ()))


def _diff(captures, tmp_path, ref, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / f"1-{ref}"), str(captures / f"2-{other}"), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text()), p.stdout, out


def _gate(out) -> int:
    return run_cli("gate", str(out), "--allow", "rounding").returncode


@pytest.mark.parametrize("opt,cls", [("adafactor", "Adafactor"), ("muon", "Muon"), ("sgdw", "SGDW")])
def test_a_correct_own_optimizer_reads_rounding(captures, tmp_path, opt, cls):
    s, stdout, out = _diff(captures, tmp_path, opt, opt)
    d = s["degrees"]["2"]
    # the parameters did move apart (the grads' rounding through the step), and each is judged
    assert not d["steps"][0]["bitwise"] and d["steps"][1]["param_max_abs"] > 0, d["steps"]
    assert s["class"] == "rounding" and not d["findings"], d["findings"]
    assert "not judged" not in stdout and "BUG" not in stdout, stdout
    assert _gate(out) == 0
    # what the capture recorded: a float64 re-execution of the step, at both steps, refused nowhere
    for side in ("1", "2"):
        w = json.loads((captures / f"{side}-{opt}" / "world.json").read_text())
        steps = w["optimizer_steps"]
        assert [e["class"] for e in steps] == [f"user_own_optim.{cls}"] * 2, steps
        assert all("refused" not in e["f64"] for e in steps), [e["f64"] for e in steps]
        up = next(p for e in steps for g in e["groups"] for p in g["params"] if p["module"] == "up")
        assert up["f64"] == [64, 32], up  # the whole matrix, at TP=2 too
        # its integer step count is state too: re-run from its value, not upcast
        assert all(e["f64"]["jumps"] == [] for e in steps), steps


@pytest.mark.parametrize("ref,bug,cls", [("muon", "muon_shard", "Muon"), ("sgdw", "sgdw_rank", "SGDW")])
def test_a_tp_only_mistake_in_the_step_is_a_bug(captures, tmp_path, ref, bug, cls):
    from tpdiag.diff.classes import leading_bug

    s, stdout, out = _diff(captures, tmp_path, ref, bug)
    d = s["degrees"]["2"]
    lead = leading_bug(d)
    assert s["class"] == "bug" and lead is not None, d["findings"]
    assert (lead["step"], lead["phase"], lead["module"], lead["kind"], lead["name"], lead["cause"]) == \
        (0, "optimizer", "up", "param", "weight", "sharding-bug"), lead
    assert f"farther from what user_own_optim.{cls}.step() computes in float64 from this degree's own" in lead["why"], lead
    assert "BUG (a wrong result, not rounding) at TP=2 optimizer: up (param weight)" in stdout, stdout
    assert _gate(out) == 4

    # the gate re-derives it from the records: the finding cut from summary.json is no pass
    copy = tmp_path / f"{bug}-edited"
    shutil.copytree(out, copy)
    e = json.loads((copy / "summary.json").read_text())
    e["class"] = e["degrees"]["2"]["class"] = "rounding"
    e["degrees"]["2"]["findings"] = [f for f in e["degrees"]["2"]["findings"] if not f.get("optimizer_step")]
    (copy / "summary.json").write_text(json.dumps(e))
    assert _gate(copy) == 2


def test_the_rule_set_is_the_diffs():
    """The shadow skips exactly the classes the diff re-runs from a rule: one more there is judged by
    nothing (no rule, no shadow), one fewer re-executed twice over."""
    from tpdiag.diff.optim_rerun import RERUN
    from tpdiag.probes import optim_shadow

    assert optim_shadow.RULE == set(RERUN)
    assert not optim_shadow.RULE & set(optim_shadow.NEVER)
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert not any(optim_shadow.applies(c(p)) for c in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW))
    assert all(optim_shadow.applies(c(p)) for c in (torch.optim.RMSprop, torch.optim.Adagrad))


@pytest.mark.parametrize("opt,classes", [
    ("rmsprop", ["torch.optim.rmsprop.RMSprop"]),
    pytest.param("torch_muon", ["torch.optim.Muon", "torch.optim.adamw.AdamW"],
                 marks=pytest.mark.skipif(not TORCH_MUON, reason="this torch has no torch.optim.Muon")),
])
def test_torchs_own_optimizer_without_a_rule_reads_rounding(captures, tmp_path, opt, classes):
    s, stdout, out = _diff(captures, tmp_path, opt, opt)
    d = s["degrees"]["2"]
    assert not d["steps"][0]["bitwise"] and d["steps"][1]["param_max_abs"] > 0, d["steps"]
    assert s["class"] == "rounding" and not d["findings"], d["findings"]
    assert "not judged" not in stdout and "BUG" not in stdout, stdout
    assert _gate(out) == 0
    for side in ("1", "2"):
        steps = json.loads((captures / f"{side}-{opt}" / "world.json").read_text())["optimizer_steps"]
        assert [e["class"] for e in steps] == classes * 2, steps
        for e in steps:
            if e["class"] == "torch.optim.adamw.AdamW":
                assert "f64" not in e, e  # its rule re-runs it in the diff
                continue
            assert e["f64"] == {"jumps": []}, e["f64"]
            up = next(p for g in e["groups"] for p in g["params"] if p["module"] == "up" and p["name"] == "weight")
            assert up["f64"] == [64, 32], up  # the whole matrix, at TP=2 too
