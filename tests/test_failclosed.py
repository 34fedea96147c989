"""Fail closed (issue 44): hostile run directories, a NaN at one degree, two compares on one
directory, shapes past the machine's memory, a capture entered twice.

Two real compares in all: the shared TP=1,2 run of conftest (`tp12_run`), whose copies the
tamper cases edit, and one forward-only compare of a model that returns NaN at TP=2, which a
second compare tries to share its directory with while it runs.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, run_cli
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy

NAN_TARGET = '''
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


class NaNAtTP2(nn.Module):
    """Identity at TP=1; NaN in one element at TP > 1 (as a 0/0 in a sharded norm would)."""

    def forward(self, x):
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            x = x.clone()
            x[..., 0, 0] = float("nan")
        return x


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = NaNAtTP2()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.mid(self.embed(input_ids))
        return self.head(h + self.fc2(torch.relu(self.fc1(h))))


def target():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(), plan={"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
                         vocab_size=VOCAB)
'''

# The policy of issue 44's report: under it a NaN at TP=2 used to PASS.
ISSUE_POLICY = 'allow_causes = ["row-parallel-reduction", "sharding-bug"]\n[budgets."*"]\nmax_abs = 1e-3\n'


def _policy(tmp_path, text, name="policy.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


# -- the NaN model, and a second compare on its directory while it runs -----------------------
@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("nan")
    (base / "nan_target.py").write_text(NAN_TARGET)
    out = base / "run"
    # Files in tpN/ that tpdiag did not write must survive; its own stale markers must not.
    (out / "tp2").mkdir(parents=True)
    (out / "tp2" / "rankings.csv").write_text("mine\n")
    (out / "tp2" / "rank0.error").write_text("{}")
    env = dict(os.environ, COLUMNS="160")
    first = subprocess.Popen([sys.executable, "-m", "tpdiag.cli", "compare", "--device", "cpu", "--model",
                              f"py:{base / 'nan_target.py'}:target", "--tp", "1,2", "--forward-only",
                              "--no-confirm", "--no-baseline", "--out", str(out), "--format", "json",
                              "--fail-on-divergence"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lock = out / ".tpdiag.lock"
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.exists(), "the first compare never locked its run directory"
    t0 = time.monotonic()
    second = run_cli("compare", "--tp", "1,2", "--forward-only", "--no-confirm", "--out", str(out))
    second_s = time.monotonic() - t0
    stdout, stderr = first.communicate(timeout=300)
    return {"out": out, "rc": first.returncode, "stdout": stdout, "stderr": stderr, "second": second,
            "second_s": second_s, "base": base}


def test_second_compare_on_a_run_directory_in_use_is_refused(nan_run):
    s = nan_run["second"]
    assert s.returncode == 2, s.stdout + s.stderr
    err = s.stderr.strip().splitlines()
    assert len(err) == 1 and "in use by another tpdiag run" in err[0] and "pid" in err[0], s.stderr
    assert nan_run["second_s"] < 60
    # The first completed untouched: its summary is its own model's (the NaN module), not tiny-llama's.
    summary = json.loads((nan_run["out"] / "summary.json").read_text())
    assert summary["degrees"]["2"]["first_divergence"]["module"] == "mid", summary
    assert not (nan_run["out"] / ".tpdiag.lock").exists()


def test_compare_deletes_only_its_own_files_in_tpN(nan_run):
    tp2 = nan_run["out"] / "tp2"
    assert (tp2 / "rankings.csv").read_text() == "mine\n"
    assert not (tp2 / "rank0.error").exists()  # a stale marker of an earlier run here


def test_nan_is_its_own_finding_never_max_abs_zero(nan_run):
    assert nan_run["rc"] == 4, nan_run["stderr"][-3000:]  # --fail-on-divergence: a non-finite finding
    d = json.loads(nan_run["stdout"])["degrees"]["2"]
    fd = d["first_divergence"]
    assert (fd["module"], fd["cause"]) == ("mid", "non-finite"), fd
    assert fd["max_abs"] == "Infinity"
    nf = d["nonfinite"]
    assert nf["first"]["module"] == "mid" and nf["first"]["value"] == "nan" and nf["records"] >= 1, nf
    from tpdiag.records.rundir import read_rows

    rows = [r for r in read_rows(str(nan_run["out"] / "diff.csv")) if r["key"] == fd["key"]]
    assert rows and rows[0]["max_abs"] == float("inf") and rows[0]["max_ulp"] is None, rows


def test_no_budget_or_allowed_cause_passes_a_nan(nan_run, tmp_path):
    res = evaluate(str(nan_run["out"]), load_policy(_policy(tmp_path, ISSUE_POLICY)))
    assert res.status == "fail" and res.exit_code == 4, res.lines()
    assert res.first_violation.cause == "non-finite" and res.first_violation.module == "mid"
    # Nor does a policy that gates no phase at all.
    res = evaluate(str(nan_run["out"]), load_policy(_policy(tmp_path, "phases = []\n", "p2.toml")))
    assert res.exit_code == 4, res.lines()


def test_policy_allowing_non_finite_is_refused_and_unknown_warned(tmp_path):
    r = _cli("gate", str(tmp_path), "--policy", _policy(tmp_path, 'allow_causes = ["non-finite"]\n'))
    assert r.exit_code == 2 and "non-finite" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    p = load_policy(_policy(tmp_path, 'allow_causes = ["unknown"]\n', "u.toml"))
    assert len(p.warnings) == 1 and "unknown" in p.warnings[0]


# -- the tamper suite over copies of the shared real TP=1,2 run --------------------------------
def _permissive(run_dir, tmp_path) -> str:
    """A policy that passes the untampered run: every cause it reports is allowed."""
    s = json.loads((run_dir / "summary.json").read_text())
    causes = set()
    for d in s["degrees"].values():
        causes.add(d["first_divergence"]["cause"])
        causes.update(f["cause"] for f in d.get("findings") or [])
    assert "non-finite" not in causes
    return _policy(tmp_path, "allow_causes = [%s]\n" % ", ".join(f'"{c}"' for c in sorted(causes)), "allow.toml")


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _fifo(p):
    p.unlink()
    os.mkfifo(p)


def _outside_link(p):
    # a genuine copy of the summary, but outside the run directory
    other = p.parent.parent / "elsewhere.json"
    other.write_text(p.read_text())
    p.unlink()
    p.symlink_to(other)


def _tool_renamed_and(r, damage):
    # issue 58: `"tool"` other than "tpdiag compare" used to switch the per-rank checks off
    _json_edit(r / "manifest.json", lambda d: d.update(tool="my-tool"))
    damage(r)


def _runs_to_copy(r):
    """The run's own records pointed at through `runs`, from a copy outside the run directory (a genuine
    copy, so the re-diff agrees: only where the records are read from is wrong)."""
    other = r.parent / "elsewhere"
    shutil.copytree(r / "tp2", other / "tp2")
    _json_edit(r / "manifest.json", lambda d: d.update(runs={"2": str(other / "tp2")}))


def _tp2_symlinked_out(r):
    other = r.parent / "elsewhere"
    other.mkdir()
    shutil.move(str(r / "tp2"), str(other / "tp2"))
    (r / "tp2").symlink_to(other / "tp2", target_is_directory=True)


def _first_divergence_zeroed(r):
    def edit(d):
        fd = d["degrees"]["2"]["first_divergence"]
        fd.update(max_ulp=0, max_abs=0.0)
    _json_edit(r / "summary.json", edit)


TAMPER = {
    "tool renamed, rank1.done deleted": lambda r: _tool_renamed_and(r, lambda r: (r / "tp2" / "rank1.done").unlink()),
    "tool renamed, rank1.error added": lambda r: _tool_renamed_and(
        r, lambda r: (r / "tp2" / "rank1.error").write_text('{"error": "boom"}')),
    "tool renamed, result.json failed": lambda r: _tool_renamed_and(
        r, lambda r: _json_edit(r / "tp2" / "result.json", lambda d: d.update(status="failed"))),
    "tool says tpdiag diff": lambda r: _json_edit(r / "manifest.json", lambda d: d.update(tool="tpdiag diff")),
    "runs entry outside the run directory": _runs_to_copy,
    "tp2 a symlink out of the run directory": _tp2_symlinked_out,
    "summary first divergence edited to 0 ULP": _first_divergence_zeroed,

    "rank1.done deleted": lambda r: (r / "tp2" / "rank1.done").unlink(),
    "rank1.error added": lambda r: (r / "tp2" / "rank1.error").write_text('{"error": "boom"}'),
    "result.json failed": lambda r: _json_edit(r / "tp2" / "result.json", lambda d: d.update(status="failed")),
    "baseline world removed": lambda r: _json_edit(r / "manifest.json", lambda d: d["worlds"].pop("1-base")),
    "summary schema true": lambda r: _json_edit(r / "summary.json", lambda d: d.update(schema=True)),
    "manifest schema 99": lambda r: _json_edit(r / "manifest.json", lambda d: d.update(schema=99)),
    "manifest schema missing": lambda r: _json_edit(r / "manifest.json", lambda d: d.pop("schema")),
    "summary symlink outside": lambda r: _outside_link(r / "summary.json"),
    "summary is a FIFO": lambda r: _fifo(r / "summary.json"),
}


@pytest.fixture()
def tampered_base(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    return dst


def test_untampered_copy_passes_the_permissive_policy(tampered_base, tmp_path):
    res = evaluate(str(tampered_base), load_policy(_permissive(tampered_base, tmp_path)))
    assert res.exit_code == 0, res.lines()  # the control: every case below starts from a pass


@pytest.mark.parametrize("case", list(TAMPER))
def test_tampered_evidence_is_inconclusive(tampered_base, tmp_path, case):
    policy = load_policy(_permissive(tampered_base, tmp_path))
    TAMPER[case](tampered_base)
    out = {}
    # In a thread: a reader that blocks on a FIFO must fail this test, not hang it.
    t = threading.Thread(target=lambda: out.update(res=evaluate(str(tampered_base), policy)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{case}: gate blocked"
    res = out["res"]
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())


def test_runs_entry_is_never_resolved_against_the_working_directory(tampered_base, tmp_path, monkeypatch):
    """A relative `runs` entry names a folder of the caller's working directory (issue 58): it is the
    run directory's or nothing."""
    policy = load_policy(_permissive(tampered_base, tmp_path))
    cwd = tmp_path / "cwd"
    shutil.copytree(tampered_base / "tp2", cwd / "recs" / "tp2")
    shutil.rmtree(tampered_base / "tp2")
    _json_edit(tampered_base / "manifest.json", lambda d: d.update(runs={"2": "recs/tp2"}))
    monkeypatch.chdir(cwd)
    res = evaluate(str(tampered_base), policy)
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()


def test_report_numbers_are_diff_csv_s(tampered_base, tmp_path):
    """summary.json's first divergence edited to 0 ULP: the report does not print the edit as the run's
    result; it says the evidence disagrees."""
    _first_divergence_zeroed(tampered_base)
    html = tmp_path / "r.html"
    r = _cli("report", str(tampered_base), "-o", str(html))
    assert r.exit_code == 2 and "0.0 but diff.csv says" in r.output, r.output  # fails closed, as the gate
    top = html.read_text()
    top = top[:top.index('id="verdict"') + 400]
    assert 'badge inconclusive">inconclusive' in top and "0.0 but diff.csv says" in top, top[-600:]


def test_phases_not_gated_never_read_as_bitwise(tp12_run, tmp_path):
    res = evaluate(str(tp12_run), load_policy(_policy(tmp_path, "phases = []\n")))
    lines = "\n".join(res.lines())
    assert res.exit_code == 0 and "bitwise" not in lines, lines
    assert "in phases the policy does not gate" in lines


def test_report_says_inconclusive_at_the_top_when_evidence_disagrees(tampered_base, tmp_path):
    (tampered_base / "tp2" / "rank1.done").unlink()
    html = tmp_path / "r.html"
    r = _cli("report", str(tampered_base), "-o", str(html))
    assert r.exit_code == 2 and "rank1.done is missing" in r.output, r.output
    text = html.read_text()
    top = text[:text.index('id="verdict"') + 400]
    assert 'badge inconclusive">inconclusive' in top and "rank1.done is missing" in top, top[-600:]
    assert "is bitwise\nequal to it" not in text  # no baseline claim over disagreeing evidence


def test_stale_lock_is_detected_and_said(tmp_path):
    from tpdiag.records.lock import NAME, hold

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import platform

    (tmp_path / NAME).write_text(json.dumps({"pid": dead.pid, "host": platform.node(), "started": "then"}))
    with hold(str(tmp_path)) as note:
        assert note and "stale lock" in note and str(dead.pid) in note and "process is gone" in note
    assert not (tmp_path / NAME).exists()


# -- shapes past the model's positions and the machine's memory --------------------------------
@pytest.mark.parametrize("args,words", [
    (["--batch-size", "100000000"], "GiB"),
    (["--seq-len", "100000000"], "4096 positions"),
    (["--seq-len", "200000"], "4096 positions"),
])
def test_huge_shapes_are_refused_before_any_world(tmp_path, args, words):
    out = tmp_path / "run"
    t0 = time.monotonic()
    # --timeout bounds the damage where nothing refuses it (a world would start and grow).
    r = _cli("compare", "--tp", "1,2", "--forward-only", "--timeout", "5", "--out", str(out), *args)
    assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert time.monotonic() - t0 < 30 and not out.exists()


# -- a capture is entered once ----------------------------------------------------------------
def test_capture_entered_twice_is_refused(tmp_path):
    import torch

    import tpdiag
    from tpdiag.errors import BadInput

    model = torch.nn.Linear(4, 4)
    cap = tpdiag.capture(model, out=str(tmp_path / "cap"), backward=False)
    with cap:
        model(torch.ones(2, 4))
    with pytest.raises(BadInput, match="already entered"):
        with cap:
            model(torch.ones(2, 4))


# -- words that claim no more than was checked -------------------------------------------------
def test_failed_reference_rerun_claims_no_reproducibility_verdict(tampered_base):
    """A reference rerun that failed (a full disk) checked nothing: neither "NOT reproducible" nor a
    first difference "at None" may be printed; the run is inconclusive and says why."""
    from rich.console import Console

    from tpdiag.cli.render import summary_tables
    from tpdiag.diff.analyse import analyse_run

    s = analyse_run(str(tampered_base), "1", ["2"], {"1-base": "rank 0: No space left on device"}, 1, "1-base")
    assert s["status"] == "inconclusive" and s["baseline"]["reproducible"] is None, s["baseline"]
    assert "not checked" in s["error"] and "No space left" in s["error"], s["error"]
    con = Console(record=True, width=200)
    summary_tables(con, dict(s, run_dir=str(tampered_base)))
    text = con.export_text()
    assert "NOT reproducible" not in text and "None" not in text and "not checked" in text, text


def test_a_tpdiag_folder_in_the_working_directory_is_not_imported(tmp_path):
    """Run from a clone's parent (a folder named tpdiag/ in the working directory) with
    `python -m tpdiag`: the parent and every rank import the real package, and a rank's own
    error reaches the output. Before: `error: TypeError: expected str, ... not NoneType`."""
    import subprocess
    import sys

    (tmp_path / "tpdiag").mkdir()
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "user_style.py")
    p = subprocess.run([sys.executable, "-m", "tpdiag", "compare", "--device", "cpu",
                        "--model", f"py:{model}:target_bad_loss",
                        "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline",
                        "--out", str(tmp_path / "r"), "--format", "json"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env={**os.environ, "PYTHONPATH": ""})
    assert p.returncode == 2, p.stderr + p.stdout
    err = json.loads(p.stdout)["degrees"]["2"]["error"]
    assert "IndexError" in err and "bad_loss" in err, err


# -- NaN held at both sides, or at the reference only (issue 58) --------------------------------
def _poisoned_target(tmp_path):
    """NAN_TARGET's model with its NaN module replaced: NaN at every degree, or at TP=1 only."""
    src = NAN_TARGET.replace("dist.get_world_size() > 1", "dist.get_world_size() > 0")
    src += '''

class NaNAtTP1(nn.Module):
    def forward(self, x):
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            x = x.clone()
            x[..., 0, 0] = float("nan")
        return x


def reference_only():
    t = target()
    t.model.mid = NaNAtTP1()
    return t
'''
    p = tmp_path / "poison.py"
    p.write_text(src)
    return p


@pytest.mark.parametrize("func,side,words", [("target", "both", "nan at the reference and TP=2"),
                                             ("reference_only", "reference", "nan at the reference only")])
def test_nan_at_every_degree_or_the_reference_is_non_finite(tmp_path, capsys, func, side, words):
    """A loss that is NaN everywhere compares bitwise equal on raw bits: it used to read "rounding only
    ... nothing is wrong" (exit 1 under --fail-on-divergence, gate PASS allowing the rounding causes)."""
    from rich.console import Console

    from tpdiag.cli.render import summary_tables

    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{_poisoned_target(tmp_path)}:{func}", "--tp", "1,2", "--forward-only",
                "--no-confirm", "--no-baseline", "--out", str(out), "--format", "json", "--fail-on-divergence")
    assert p.returncode == 4, p.stderr[-3000:]
    s = json.loads(p.stdout)
    d = s["degrees"]["2"]
    assert s["class"] == "non-finite" and d["first_divergence"]["cause"] == "non-finite", d["first_divergence"]
    assert d["first_divergence"]["module"] == "mid" and d["nonfinite"]["first"]["side"] == side, d["nonfinite"]
    def floats(o):  # --format json writes NaN/Inf as strings (io.json_safe); the renderer takes floats
        if isinstance(o, dict):
            return {k: floats(v) for k, v in o.items()}
        if isinstance(o, list):
            return [floats(v) for v in o]
        return float(o.replace("Infinity", "inf")) if o in ("NaN", "Infinity", "-Infinity") else o

    con = Console(record=True, width=200)
    summary_tables(con, dict(floats(s), run_dir=str(out)))
    text = con.export_text() + capsys.readouterr().out  # the tables print to stdout
    assert words in text and "nothing is wrong" not in text and "rounding only" not in text, text
    everything = 'allow_causes = ["row-parallel-reduction", "shape-dependent-gemm", "sharding-bug", "unknown"]\n'
    res = evaluate(str(out), load_policy(_policy(tmp_path, everything)))
    assert res.exit_code == 4 and res.first_violation.cause == "non-finite", res.lines()
    # its own class, not "a BUG" (a wrong result): the headline says which
    assert "NaN or Inf (NON-FINITE) beyond policy" in res.lines()[0], res.lines()


def test_hash_records_holding_nan_at_both_sides_are_non_finite():
    """Hash capture keeps a count of NaN/Inf per record, not values: equal hashes of a loss that holds
    one at both sides are still a non-finite finding (a forward record's count may be a mask's -inf)."""
    from tpdiag.diff.engine import _hash_row

    rec = {"stored": "hash", "full_hash": "ab12", "dtype": "float32", "full_shape": [4], "kind": "out",
           "key": "s0/loss/model/out#0/0", "idx": 0, "step": 0, "phase": "loss", "module": "model", "call": 0,
           "name": "0", "cls": None, "style": None, "world": 1, "hash_layout": "full",
           "stats": {"nonfinite": 1, "sum": 0.0, "sumsq": 1.0, "absmax": 1.0}}
    row, _ = _hash_row(rec, dict(rec), "2")
    assert row["bitwise"] is False and row["nonfinite_mismatch"] and row["nonfinite_side"] == "both", row
    assert _hash_row(rec, dict(rec), "2", values=False)[0]["bitwise"] is True  # a reference rerun: bits only
    fwd = dict(rec, phase="forward")
    assert _hash_row(fwd, dict(fwd), "2")[0]["bitwise"] is True
    clean = dict(rec, stats=dict(rec["stats"], nonfinite=0))
    assert _hash_row(clean, dict(clean), "2")[0]["bitwise"] is True
