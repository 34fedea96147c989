"""Tamper suite, the float64 evidence (red team hred13): a first divergence judged "within rounding" by its
float64 re-execution keeps that re-execution on disk.

conftest's TP=1,2 compare of the built-in model (shared; each case edits a copy): its first divergence, a
row-parallel all-reduce, is judged by the second pass's float64 re-execution of the module, whose result
the pass's reference world wrote as records of kind `oracle` (ops/tp1). The gate hash-checks the second
pass's records but does not re-diff them or re-run the oracle, so on 170f498 those records removed from
ops/tp1/events.jsonl (world.json's count with them) - every one, or the module's alone - left the verdict
standing and `gate --allow rounding` passed (exit 0). Now inconclusive (diff/oracle_evidence.py) for gate
and report.
"""
import json
import shutil

import pytest
from conftest import run_cli

from tpdiag.gate import evaluate, load_policy, with_allowed


@pytest.fixture()
def run(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    return dst


def _rounding():
    return with_allowed(load_policy(None), "rounding")


def _drop(world, pred):
    """Records removed from a world's index as a consistent edit would: events.jsonl, world.json's count
    and their tensors (a tensor no record names is refused on its own: records/completeness.py)."""
    from safetensors.torch import load_file, save_file

    ev = [json.loads(x) for x in (world / "events.jsonl").read_text().splitlines()]
    keep = [m for m in ev if not pred(m)]
    assert len(keep) < len(ev)
    gone = {str(m["idx"]) for m in ev if pred(m)}
    tensors = load_file(str(world / "records.safetensors"))
    save_file({k: t for k, t in tensors.items() if k not in gone}, str(world / "records.safetensors"),
              metadata={"schema": "1"})
    (world / "events.jsonl").write_text("".join(json.dumps(m) + "\n" for m in keep))
    w = json.loads((world / "world.json").read_text())
    w["n_records"] = len(keep)
    (world / "world.json").write_text(json.dumps(w))


def test_the_untouched_run_passes_as_rounding(tp12_run):
    fd = json.loads((tp12_run / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    assert fd["oracle"]["far"] is False and fd["second_pass_dir"].endswith("ops"), fd
    res = evaluate(str(tp12_run), _rounding())
    assert res.exit_code == 0, res.lines()


@pytest.mark.parametrize("which", ["every", "the module's"])
def test_the_float64_records_removed_are_inconclusive(run, tmp_path, which):
    fd = json.loads((run / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    _drop(run / "ops" / "tp1", lambda m: m["kind"] == "oracle" and (which == "every" or m["module"] == fd["module"]))
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()
    assert any("holds no float64 re-execution" in p for p in res.problems), res.problems
    r = run_cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and "holds no float64 re-execution" in r.stdout + r.stderr, r.stdout + r.stderr
