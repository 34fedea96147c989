"""Fail closed, round 4: a second pass whose worlds failed. The float64 pass (ops/) re-executes the
first divergence and judges the modules past it on their own inputs; when its worlds failed (a full
disk - WriteError - a crash, a timeout) it judged nothing, yet compare printed "rounding only" from the
first pass's layout bound alone and the gate passed with --allow rounding (exit 0; seen on a 24 MiB
tmpfs). Now compare calls the degree not judged (class unknown), and gate, report and load say the
second pass failed (exit 2). And the gate now honours compare's own "not judged" (downstream_unjudged):
only a policy allowing `unknown` by name passes it.

The write failure is real: a directory planted where the second pass's TP=2 rank writes its
records.safetensors (as root, permissions cannot stop a write; a directory can), between the two passes.
"""
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy
from tpdiag.gate.policy import with_allowed


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture(scope="module")
def broken_second_pass(tmp_path_factory, request):
    from tpdiag.runner import drill

    out = tmp_path_factory.mktemp("broken") / "run"
    real = drill.drill_down

    def planted(cfg, summary, run_dir, *a, **k):
        os.makedirs(os.path.join(run_dir, "ops", "tp2", "records.safetensors", "x"))
        return real(cfg, summary, run_dir, *a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(drill, "drill_down", planted)
    try:
        r = _cli("compare", "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline", "--batch-size", "1",
                 "--seq-len", "4", "--out", out)
    finally:
        mp.undo()
    return out, r


def test_compare_does_not_call_it_rounding_only(broken_second_pass):
    out, r = broken_second_pass
    assert "Traceback" not in r.output, r.output
    head = r.output.splitlines()[0]
    assert "not judged" in head and "rounding only" not in head and "the float64 rerun failed" in r.output, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["degrees"]["2"]["class"] == "unknown", s["degrees"]["2"]
    sub = json.loads((out / "ops" / "summary.json").read_text())
    assert "WriteError" in sub["degrees"]["2"]["error"], sub  # the write really failed
    # compare's own exit code: a world of its second pass failed - inconclusive (2), as the gate says
    # (it exited 0 before, with the verdict of the first pass alone)
    assert r.exit_code == 2 and "the second pass in ops/ failed" in r.output, (r.exit_code, r.output)


def test_gate_report_and_load_say_the_second_pass_failed(broken_second_pass, tmp_path):
    import tpdiag
    from tpdiag.errors import Inconclusive

    out, _ = broken_second_pass
    res = evaluate(str(out), _rounding())
    assert res.exit_code == 2 and "the second pass in ops/ failed" in res.problems[0], res.lines()
    r = _cli("gate", out, "--allow", "rounding")
    assert r.exit_code == 2 and "the second pass in ops/ failed" in r.output.splitlines()[0], r.output
    r = _cli("report", out, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "the second pass in ops/ failed" in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(Inconclusive, match="the second pass in ops/ failed"):
        tpdiag.load(str(out))


def test_the_gate_honours_compare_s_not_judged(tp12_run, tmp_path):
    """compare's own verdict "not judged" (a float64 pass that computed another step: drill.py) read as
    unknown there and passed the gate with --allow rounding (exit 0); it fails (exit 1) unless the
    policy allows `unknown` by name."""
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run, symlinks=True)
    assert evaluate(str(run), _rounding()).exit_code == 0  # the control
    s = json.loads((run / "summary.json").read_text())
    s["degrees"]["2"]["downstream_unjudged"] = "the float64 pass computed another step than the first pass (x)"
    from tpdiag.diff.classes import add_classes

    add_classes(s)  # as compare classes it (unknown): the gate re-derives the class from the causes
    (run / "summary.json").write_text(json.dumps(s))
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 1 and res.first_violation.cause == "unknown", res.lines()
    assert "not judged: the float64 pass computed another step" in res.lines()[0], res.lines()
    assert evaluate(str(run), with_allowed(_rounding(), "unknown")).exit_code == 0
