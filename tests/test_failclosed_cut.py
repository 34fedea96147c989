"""A run cut short or half-written on disk, and a second pass's own files dropped with what named them,
never pass the gate (red team hred11). One tiny-llama `--capture hash` compare (TP=1,2: rounding only,
so `gate --allow rounding` passes it untouched - the control); each case edits a copy.

On the code before, each case below passed `gate --allow rounding` (exit 0):
- the own-input pass (region/ops/) deleted together with region/summary.json's `own_inputs`, the list of
  modules it was run for;
- the region pass's (or its own-input pass's) diff.csv cut in half: its rows are read as written, not
  re-derived, and the rows lost took the findings they demand with them;
- a rank's marker (rankR.done) cut to nothing or half, or another rank's copied over it: only its
  existence was checked.
"""
import json
import shutil

import pytest
from conftest import run_cli

from tpdiag.gate.policy import Policy, with_allowed
from tpdiag.gate.verdict import evaluate

ROUNDING = with_allowed(Policy(), "rounding")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cut") / "run"
    p = run_cli("compare", "--tp", "1,2", "--capture", "hash", "--no-confirm", "--no-baseline", "--format", "json",
                "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    assert (d / "region" / "ops" / "summary.json").is_file()  # the own-input pass ran
    return d


def _copy(run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run, d)
    return d


def _inconclusive(d, words):
    res = evaluate(str(d), ROUNDING)
    assert res.exit_code == 2 and any(words in p for p in res.problems), (res.exit_code, res.problems)


def test_the_untouched_run_passes_allow_rounding(run):
    res = evaluate(str(run), ROUNDING)
    assert res.exit_code == 0, res.problems


def test_the_own_input_pass_deleted_with_its_modules_is_inconclusive(run, tmp_path):
    d = _copy(run, tmp_path)
    shutil.rmtree(d / "region" / "ops")
    p = d / "region" / "summary.json"
    s = json.loads(p.read_text())
    assert s["degrees"]["2"].pop("own_inputs")
    p.write_text(json.dumps(s))
    _inconclusive(d, "names no module to judge on its own inputs, but its diff.csv and records leave")


@pytest.mark.parametrize("where", ["region", "region/ops"])
def test_a_second_pass_diff_csv_cut_short_is_inconclusive(run, tmp_path, where):
    d = _copy(run, tmp_path)
    p = d / where / "diff.csv"
    lines = p.read_bytes().splitlines(keepends=True)
    # cut at a row's end: a cut inside a number reads "corrupt" instead (also exit 2), and where the
    # half falls moves with what the pass records; the row count is the check under test here
    p.write_bytes(b"".join(lines[:len(lines) // 2]))
    _inconclusive(d, "rows of TP=2 but summary.json says")


@pytest.mark.parametrize("marker,cut,words", [
    ("tp2/rank1.done", 0, "tp2/rank1.done is unreadable"),
    ("tp1/rank0.done", 0.5, "tp1/rank0.done is unreadable"),
    ("region/tp2/rank0.done", "rank1", "tp2/rank0.done is not rank 0's marker"),
    ("region/ops/tp1/rank0.done", 0, "tp1/rank0.done is unreadable"),
])
def test_a_rank_marker_cut_or_another_ranks_is_inconclusive(run, tmp_path, marker, cut, words):
    d = _copy(run, tmp_path)
    p = d / marker
    if cut == "rank1":
        shutil.copyfile(d / "tp2" / "rank1.done", p)
    else:
        b = p.read_bytes()
        p.write_bytes(b[:int(len(b) * cut)])
    _inconclusive(d, words)


def test_tpdiag_diff_of_a_world_with_a_cut_marker_is_refused(run, tmp_path):
    from typer.testing import CliRunner

    from tpdiag.cli import app

    d = _copy(run, tmp_path)
    (d / "tp2" / "rank1.done").write_bytes(b"")
    r = CliRunner().invoke(app, ["diff", str(d / "tp1"), str(d / "tp2"), "--out", str(tmp_path / "dd")])
    assert r.exit_code == 2 and "rank 1 did not finish this world (rank1.done is unreadable" in r.output, r.output
