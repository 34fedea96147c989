"""`tpdiag gate`: exit 0/1/2 by policy, fail closed on incomplete or edited evidence, JUnit per degree."""
import json
import os
import shutil
import xml.etree.ElementTree as ET

import pytest
from conftest import run_cli

from tpdiag.gate import evaluate, load_policy
from tpdiag.errors import BadInput


@pytest.fixture()
def run(tp12_run, tmp_path):
    """A private copy of the shared TP=1,2 run that a test may damage."""
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    return dst


def _first(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["degrees"]["2"]["first_divergence"]


def _policy(tmp_path, text):
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return str(p)


def test_stock_run_fails_naming_the_first_divergent_module(tp12_run, tmp_path):
    fd = _first(tp12_run)
    junit = tmp_path / "junit.xml"
    p = run_cli("gate", str(tp12_run), "--junit", str(junit), env={"GITHUB_ACTIONS": "true"})
    assert p.returncode == 1, p.stdout + p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("gate: FAIL")
    for part in (f"module {fd['module']}", f"phase {fd['phase']}", f"cause {fd['cause']}"):
        assert part in first
    # a module-granularity run: its words say module and name no op
    assert fd.get("op") is None and "first divergent module beyond policy" in first and "op -" not in first
    assert "TP=2: fail (1 record beyond policy" in p.stdout
    # compare called this run rounding only: the option that lets it through is named
    assert "policy: default (nothing may diverge) (--allow rounding lets rounding-class causes through;" in p.stdout
    assert f"::error title=tpdiag::first divergent module beyond policy: TP=2: module {fd['module']}" in p.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["TP=2 vs TP=1"]
    assert suite.get("tests") == "1" and suite.get("failures") == "1"
    assert fd["module"] in cases[0].find("failure").get("message")


def test_allowed_cause_passes_with_junit(tp12_run, tmp_path):
    cause = _first(tp12_run)["cause"]
    assert cause == "row-parallel-reduction"
    junit = tmp_path / "out" / "junit.xml"
    p = run_cli("gate", str(tp12_run), "--policy", _policy(tmp_path, f'allow_causes = ["{cause}"]\n'),
                "--junit", str(junit), "--format", "json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["status"] == "pass"
    case = ET.parse(junit).getroot().find("testsuite/testcase")
    assert case.find("failure") is None and case.find("error") is None


def test_budget_at_the_observed_divergence_passes_and_one_ulp_less_fails(tp12_run, tmp_path):
    fd = _first(tp12_run)
    text = f'[budgets."{fd["module"]}"]\nmax_ulp = {{}}\nphases = ["{fd["phase"]}"]\n'
    ok = evaluate(str(tp12_run), load_policy(_policy(tmp_path, text.format(fd["max_ulp"]))))
    assert ok.exit_code == 0, ok.lines()
    tight = evaluate(str(tp12_run), load_policy(_policy(tmp_path, text.format(fd["max_ulp"] - 1))))
    assert tight.exit_code == 1
    v = tight.first_violation
    assert (v.module, v.phase) == (fd["module"], fd["phase"]) and "budget" in v.reason


def test_ungated_degree_and_phase(tp12_run, tmp_path):
    res = evaluate(str(tp12_run), load_policy(_policy(tmp_path, 'phases = ["init"]\n')))
    assert res.exit_code == 0, res.lines()  # weights and batch are identical at every degree
    res = evaluate(str(tp12_run), load_policy(_policy(tmp_path, "degrees = [4]\n")))
    assert res.exit_code == 2 and "policy gates TP=4" in res.problems[0]


def test_truncated_safetensors_is_inconclusive(run, tmp_path):
    path = run / "tp2" / "records.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    junit = tmp_path / "junit.xml"
    p = run_cli("gate", str(run), "--junit", str(junit), "--policy",
                _policy(tmp_path, 'allow_causes = ["row-parallel-reduction"]\n'))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "INCONCLUSIVE" in p.stdout and "truncated" in p.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("errors") == "1" and len(suite.findall("testcase")) == 1


def test_missing_degree_is_inconclusive(run):
    shutil.rmtree(run / "tp2")
    p = run_cli("gate", str(run))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "TP=2" in p.stdout.splitlines()[0]


def _flip_first_tensor_bit(path):
    """Flip one bit of the first stored tensor (the batch or an initial weight: bitwise equal in the run)."""
    import struct

    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    first = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    data[8 + n + first + 3] ^= 0x01
    path.write_bytes(bytes(data))


def test_edited_records_are_inconclusive(run):
    _flip_first_tensor_bit(run / "tp2" / "records.safetensors")
    res = evaluate(str(run), load_policy(None))
    # caught by the record's stored hash on read (or, failing that, by the re-diff vs diff.csv)
    assert res.exit_code == 2 and ("does not match its hash" in res.problems[0]
                                   or "does not match diff.csv" in res.problems[0])


def test_edited_reference_rerun_is_inconclusive(run, tmp_path):
    base = (json.loads((run / "summary.json").read_text()).get("baseline") or {}).get("label")
    if not base:
        pytest.skip("this compare ran without a reference rerun")
    _flip_first_tensor_bit(run / f"tp{base}" / "records.safetensors")
    res = evaluate(str(run), load_policy(_policy(tmp_path, 'allow_causes = ["row-parallel-reduction"]\n')))
    assert res.exit_code == 2 and "reference rerun" in res.problems[0]


@pytest.mark.parametrize("damage", ["summary-missing", "summary-inconclusive", "summary-edited",
                                    "events-truncated", "csv-missing"])
def test_incomplete_evidence_fails_closed(run, damage):
    s = json.loads((run / "summary.json").read_text())
    if damage == "summary-missing":
        (run / "summary.json").unlink()
    elif damage == "summary-inconclusive":
        s["status"] = "inconclusive"
        (run / "summary.json").write_text(json.dumps(s))
    elif damage == "summary-edited":
        s["degrees"]["2"].update(status="bitwise", first_divergence=None)
        (run / "summary.json").write_text(json.dumps(s))
    elif damage == "events-truncated":
        lines = (run / "tp2" / "events.jsonl").read_text().splitlines(keepends=True)
        (run / "tp2" / "events.jsonl").write_text("".join(lines[: len(lines) // 2]))
    else:
        (run / "diff.csv").unlink()
    res = evaluate(str(run), load_policy(None))
    assert res.exit_code == 2 and res.problems, res.lines()


def test_bad_policy_is_one_line_exit_2(tp12_run, tmp_path):
    p = run_cli("gate", str(tp12_run), "--policy", _policy(tmp_path, 'allow_causes = ["row-parallel"]\n'))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "row-parallel-reduction" in p.stderr
    for text in ('max_ulp = 3\n', '[budgets."*"]\nmax_ulps = 3\n', '[budgets."*"]\n', "degrees = [\n"):
        with pytest.raises(BadInput):
            load_policy(_policy(tmp_path, text))
