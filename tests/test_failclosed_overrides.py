"""Fail closed, round 4: a bug verdict overridden after locate must be what the overriding pass's own
files say. tests/models/planted/behind.py:bugs at TP=1,2 with its confirmation (tp-invariant-linear:
not confirmed) has a sharding-bug and a rank-inconsistent replica. summary.json edited to relabel both
as rounding (`cause_before` kept, the confirming fix named as the reason) with the confirmation made
`confirmed` passed `gate --allow rounding` (exit 0) and `report` (exit 0) on main. Now the confirmation is
re-derived from its own run directory (records re-read and re-diffed) and each relabel needs its pass's
evidence: inconclusive (exit 2) for gate, report and load.
"""
import json
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy
from tpdiag.gate.policy import with_allowed
from tpdiag.records.causes import EXIT_BUG

CONFIRMING = "the confirming fix (tp-invariant-linear) makes this record bitwise"


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


@pytest.fixture(scope="module")
def bugs_confirmed(tmp_path_factory):
    out = tmp_path_factory.mktemp("ovr") / "run"
    r = _cli("compare", "--model", "py:tests/models/planted/behind.py:bugs", "--tp", "1,2", "--dtype", "float32",
             "--judge-downstream", "--no-baseline", "--out", out)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture()
def run(bugs_confirmed, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(bugs_confirmed, dst, symlinks=True)
    return dst


def _edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _relabel(why=CONFIRMING, verdict="confirmed"):
    def fn(s):
        d = s["degrees"]["2"]
        if verdict:
            d["confirmation"]["verdict"] = verdict
        for f in d["findings"]:
            if f["cause"] in ("sharding-bug", "rank-inconsistent-replica"):
                f.update(cause_before=f["cause"], cause="row-parallel-reduction", why=why)
        s["class"] = d["class"] = "rounding"
    return fn


def _moved_to(s):
    s["degrees"]["2"]["confirmation"]["first_divergence_after"]["key"] = "s0/loss/model/logprobs#0/logprobs"


EDITS = {
    "relabelled, confirmation made confirmed": (_relabel(), "says confirmed but its records say not-confirmed"),
    "relabelled, confirmation left not confirmed": (_relabel(verdict=None), "which the run's own files do not support"),
    "relabelled by no rule": (_relabel(why="looks fine", verdict=None), "which the run's own files do not support"),
    "relabelled as within rounding on own inputs": (
        _relabel(why="re-executed in float64 from this side's own inputs it is within rounding: not a bug",
                 verdict=None), "which the run's own files do not support"),
    "where the confirmation moved, edited": (_moved_to, "summary.json says the first divergence moves to"),
}


def test_the_untouched_run_fails_on_its_bugs(run):
    s = json.loads((run / "summary.json").read_text())
    assert s["degrees"]["2"]["confirmation"]["verdict"] == "not-confirmed"
    assert evaluate(str(run), with_allowed(load_policy(None), "rounding")).exit_code == EXIT_BUG


@pytest.mark.parametrize("case", list(EDITS))
def test_an_override_its_pass_does_not_support_is_inconclusive(run, tmp_path, case):
    import tpdiag
    from tpdiag.errors import Inconclusive

    edit, words = EDITS[case]
    _edit(run / "summary.json", edit)
    res = evaluate(str(run), with_allowed(load_policy(None), "rounding"))
    assert res.exit_code == 2 and words in res.problems[0], (case, res.lines())
    r = _cli("report", run, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, (case, r.output)
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(run))


def test_the_confirmation_run_edited_to_agree_is_caught_by_its_records(run):
    """The confirmation's own diff.csv and summary edited to say the first divergence is now bitwise (so
    the override reads as supported): its records, re-diffed, say otherwise."""
    conf = run / "confirm" / "tp-invariant-linear"
    key = json.loads((run / "summary.json").read_text())["degrees"]["2"]["first_divergence"]["key"]
    lines = (conf / "diff.csv").read_text().splitlines(keepends=True)
    head = lines[0].rstrip("\n").split(",")
    col = head.index("bitwise")
    lines = [ln if f",{key}," not in ln else ",".join(
        "True" if i == col else v for i, v in enumerate(ln.rstrip("\n").split(","))) + "\n" for ln in lines]
    (conf / "diff.csv").write_text("".join(lines))
    _edit(run / "summary.json", _relabel())
    res = evaluate(str(run), with_allowed(load_policy(None), "rounding"))
    assert res.exit_code == 2 and "the confirmation of TP=2 (confirm/tp-invariant-linear)" in res.problems[0], res.lines()


def test_a_second_pass_bug_deleted_from_both_summaries_is_inconclusive(run, tmp_path):
    """The sharding-bug only the second pass found, deleted from summary.json AND ops/summary.json: the
    cross-check between the two found nothing missing and the gate passed (exit 0, a policy allowing the
    run's other causes). The second pass's own diff.csv still has the record beyond its bound."""
    policy = load_policy(str(tmp_path / "p.toml")) if (tmp_path / "p.toml").write_text(
        'allow_causes = ["row-parallel-reduction", "rank-inconsistent-replica"]\n') else None
    assert evaluate(str(run), policy).exit_code == EXIT_BUG  # the control

    def drop(s):
        d = s["degrees"]["2"]
        d["findings"] = [f for f in d["findings"] if f["cause"] != "sharding-bug"]
    _edit(run / "summary.json", drop)
    _edit(run / "ops" / "summary.json", drop)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and res.problems[0].startswith("the second pass in ops/: summary.json's TP=2 findings "
                                                             "lack s0/backward/kv/param_grad#0/wv"), res.lines()
