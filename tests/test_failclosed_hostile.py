"""Fail closed, round 3 (an adversarial review): a manifest that describes another run, a world's
files symlinked out of the run, summary/manifest disagreeing on the degrees or the reference, a
second pass removed from summary.json (or never finished: a compare killed during it), a bug in a
phase the policy leaves out, a policy gating no degree, `tpdiag.load` of an edited run, an empty
batch. Each case passed the gate (exit 0), or `report`/`load` showed it as the run's result, or
crashed, before this change; each is now inconclusive (exit 2), a failure (exit 4) or one line.

Edits are made to copies of conftest's session runs (tp12_run: tiny-llama at TP=1,2;
behind_bugs_run: a rounding first divergence with a rank-inconsistent replica and a
sharding-bug only the second pass finds behind it); one small compare of its own (forward only,
TP=1,2) is stopped at its second pass.
"""
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.errors import BadInput, Inconclusive
from tpdiag.gate import evaluate, load_policy
from tpdiag.records.causes import EXIT_BUG


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _policy(tmp_path, text, name="policy.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _permissive(run, tmp_path):
    """Every cause the untouched run reports is allowed: it passes (the control)."""
    s = json.loads((run / "summary.json").read_text())
    causes = set()
    for d in s["degrees"].values():
        causes.add(d["first_divergence"]["cause"])
        causes.update(f["cause"] for f in d.get("findings") or [])
    return load_policy(_policy(tmp_path, "allow_causes = [%s]\n" % ", ".join(f'"{c}"' for c in sorted(causes))))


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    return dst


@pytest.fixture()
def bugs(behind_bugs_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(behind_bugs_run, dst, symlinks=True)
    return dst


# -- the tp12 run, edited: gate, report and load all refuse it --------------------------------
def _settings(key, value):
    def edit(r):
        def fn(d):
            d[key] = value
            if key in d["config"]:
                d["config"][key] = value
        _json_edit(r / "manifest.json", fn)
    return edit


def _symlinked_out(name):
    def edit(r):
        other = r.parent / f"elsewhere-{name}"
        shutil.copy(r / "tp2" / name, other)  # a genuine copy: only where it is read from is wrong
        (r / "tp2" / name).unlink()
        (r / "tp2" / name).symlink_to(other)
    return edit


EDITS = {
    # the records are tiny-llama's, float32, seed 1234: the manifest says they are another run's
    "manifest model": _settings("model", "hf:/models/other"),
    "manifest dtype": _settings("dtype", "bfloat16"),
    "manifest seed": _settings("seed", 7),
    "manifest hash version": lambda r: _json_edit(r / "manifest.json", lambda d: d.update(hash_version=1)),
    "manifest config removed, model edited": lambda r: _json_edit(
        r / "manifest.json", lambda d: (d.pop("config"), d.update(model="hf:/models/other"))),
    "records.safetensors symlinked out": _symlinked_out("records.safetensors"),
    "events.jsonl symlinked out": _symlinked_out("events.jsonl"),
    "result.json symlinked out": _symlinked_out("result.json"),
    "summary reference edited": lambda r: _json_edit(r / "summary.json",
                                                     lambda d: d.update(reference=2, reference_label="2")),
    # the reference rerun reproduced it bitwise: summary.json edited to say it did not, or to say
    # nothing of it (the report then printed "NOT reproducible" / the gate passed either way)
    "summary baseline says not reproducible": lambda r: _json_edit(
        r / "summary.json", lambda d: d["baseline"].update(reproducible=False)),
    "summary baseline removed": lambda r: _json_edit(r / "summary.json", lambda d: d.pop("baseline")),
}


def test_the_untouched_copy_passes_and_loads(tp12, tmp_path):
    import tpdiag

    assert evaluate(str(tp12), _permissive(tp12, tmp_path)).exit_code == 0
    assert tpdiag.load(str(tp12)).summary["status"] == "divergent"


@pytest.mark.parametrize("case", list(EDITS))
def test_an_edit_is_inconclusive_for_gate_report_and_load(tp12, tmp_path, case):
    import tpdiag

    policy = _permissive(tp12, tmp_path)
    EDITS[case](tp12)
    res = evaluate(str(tp12), policy)
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    r = _cli("report", tp12, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "evidence disagrees" in r.output and "Traceback" not in r.output, (case, r.output)
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(tp12))


def test_a_degree_the_manifest_does_not_list_is_inconclusive_for_the_report(tp12, tmp_path):
    """manifest.json cut to the reference alone: the gate said so (exit 2), the report exited 0."""
    _json_edit(tp12 / "manifest.json", lambda d: d.update(degrees=[1], labels=["1"]))
    assert evaluate(str(tp12)).exit_code == 2
    r = _cli("report", tp12, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "summary.json has TP=2, which manifest.json does not list" in r.output, r.output


def test_load_checks_what_the_report_checks(tp12):
    """A summary edited to bitwise: tpdiag.load returned it as the run's result. check=False is the
    caller's explicit choice (no re-diff) and still reads the frames."""
    import tpdiag

    def edit(d):
        d["status"] = "bitwise"
        for e in d["degrees"].values():
            e.update(status="bitwise", first_divergence=None, findings=[], n_divergent=0)
    _json_edit(tp12 / "summary.json", edit)
    with pytest.raises(Inconclusive, match="says TP=2 is bitwise but diff.csv has"):
        tpdiag.load(str(tp12))
    assert tpdiag.load(str(tp12), check=False).summary["status"] == "bitwise"


def _flip_a_record_bit(path):
    """One bit of the first stored tensor (the batch: bitwise equal at both degrees in the run)."""
    import struct

    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    first = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    data[8 + n + first + 3] ^= 0x01
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)  # a new file of the same name and size, as a copy over it would leave


def test_a_record_edited_between_two_checks_in_one_process_is_caught(tp12, tmp_path):
    """A long-lived process (a notebook, a CI script calling gate.evaluate twice) checks a run, then
    its records change: the second check must read them again, not trust the first one's hashes
    (a guard for any per-process cache of verified record hashes)."""
    policy = _permissive(tp12, tmp_path)
    assert evaluate(str(tp12), policy).exit_code == 0
    _flip_a_record_bit(tp12 / "tp2" / "records.safetensors")
    res = evaluate(str(tp12), policy)
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()


# -- the bugs run: the second pass's finding, and the bugs behind a phase list -----------------
def _allow(tmp_path, *causes):
    return load_policy(_policy(tmp_path, "allow_causes = [%s]\n" % ", ".join(f'"{c}"' for c in causes), "a.toml"))


def test_the_second_pass_removed_from_summary_json_is_inconclusive(bugs, tmp_path):
    """The sharding-bug only the second pass found, deleted with summary.json's `second_pass` (and,
    the second time, with the first divergence's pointer to it): exit 0 before."""
    policy = _allow(tmp_path, "row-parallel-reduction", "rank-inconsistent-replica")
    assert evaluate(str(bugs), policy).exit_code == EXIT_BUG  # the control: its sharding-bug fails

    def drop(s):
        s.pop("second_pass")
        d = s["degrees"]["2"]
        d["findings"] = [f for f in d["findings"] if f.get("from") != "second pass"]

    _json_edit(bugs / "summary.json", drop)
    res = evaluate(str(bugs), policy)
    assert res.exit_code == 2 and "has no second_pass" in res.problems[0], res.lines()
    _json_edit(bugs / "summary.json", lambda s: s["degrees"]["2"]["first_divergence"].pop("second_pass_dir"))
    res = evaluate(str(bugs), policy)
    assert res.exit_code == 2 and "ops/ holds a second pass of this run" in res.problems[0], res.lines()


@pytest.mark.parametrize("phases", ['["forward"]', '["init"]', "[]"])
def test_a_bug_in_a_phase_the_policy_leaves_out_still_fails(bugs, tmp_path, phases):
    """The replica whose ranks disagree and the sharding-bug sit in backward: a policy gating
    forward only (docs/ci.md's adoption recipe) passed them (exit 0)."""
    policy = load_policy(_policy(tmp_path, f'allow_causes = ["row-parallel-reduction"]\nphases = {phases}\n'))
    res = evaluate(str(bugs), policy)
    assert res.exit_code == EXIT_BUG, res.lines()
    assert res.first_violation.phase == "backward", res.lines()
    # allowed by name, the bugs pass: the policy's explicit choice
    named = load_policy(_policy(tmp_path, 'allow_causes = ["row-parallel-reduction", "rank-inconsistent-replica", '
                                          f'"sharding-bug"]\nphases = {phases}\n', "named.toml"))
    assert evaluate(str(bugs), named).exit_code == 0


def test_a_policy_gating_no_degree_is_refused(tmp_path):
    with pytest.raises(BadInput, match="degrees = \\[\\] gates no degree"):
        load_policy(_policy(tmp_path, "degrees = []\n"))
    r = _cli("gate", tmp_path, "--policy", _policy(tmp_path, "degrees = []\n"))
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output


# -- a compare stopped during its second pass --------------------------------------------------
def test_a_compare_stopped_during_its_second_pass_is_incomplete(tmp_path, monkeypatch):
    """manifest.json got its status when the first pass ended: a compare killed during the second
    pass (or the confirmation) left a directory the gate judged as complete, without the findings
    only the second pass makes. Stopped here by an error in the second pass (in process)."""
    from tpdiag.records.rundir import read_manifest
    from tpdiag.runner import drill

    out = tmp_path / "run"
    seen = {}

    def stopped(cfg, summary, run_dir, *a, **k):
        seen["status"] = read_manifest(run_dir).get("status")
        raise KeyboardInterrupt  # what SIGINT/SIGTERM become in compare

    monkeypatch.setattr(drill, "drill_down", stopped)
    r = _cli("compare", "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline", "--batch-size", "1",
             "--seq-len", "4", "--out", out)
    assert "status" in seen and seen["status"] is None, (seen, r.output)
    res = evaluate(str(out), load_policy(None))
    assert res.exit_code == 2 and "incomplete run" in res.problems[0], res.lines()


# -- an empty batch, an empty call ---------------------------------------------------------------
def test_an_empty_batch_is_refused_and_an_empty_call_is_within_its_bound(tmp_path):
    """A Linear called on no rows (an expert no token reached) crashed the diff's bound check
    (IndexError: `tpdiag diff` said 'malformed run directory'); an empty batch is one line at its source."""
    import torch

    import tpdiag
    from tpdiag.diff import bounds

    chk = bounds.check(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 4))
    assert (chk.bound, chk.ratio, chk.beyond) == (0.0, 0.0, False)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(BadInput, match="empty tensor"):
        with tpdiag.capture(model, out=str(tmp_path / "cap"), backward=False) as cap:
            cap.batch(input_ids=torch.empty(0, 8, dtype=torch.long))
    assert not os.path.exists(tmp_path / "cap" / "summary.json")
