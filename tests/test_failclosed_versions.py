"""Fail closed, round 4 (adversarial review): which tpdiag wrote a world's records. world.json named
its lane-mix version but neither its record layout nor the tpdiag that wrote it, so records of another
layout (a newer or older tpdiag's) or a world another tpdiag wrote, left in a reused directory or copied
in, were read as this run's: the gate passed them (exit 0). Now world.json carries `record_format` and
`tpdiag`: another format is refused in one line (exit 2) by every reader, a world whose tpdiag is not
the manifest's is inconclusive, and a run older than the fields is format 1: refused too (its op records
were keyed otherwise).

Edits are made to copies of conftest's session run tp12_run (tiny-llama at TP=1,2).
"""
import json
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    return dst


def _rounding(tmp_path):
    from tpdiag.gate.policy import with_allowed

    return with_allowed(load_policy(None), "rounding")


def _worlds(run):
    return sorted(p for p in run.rglob("world.json"))


def test_world_json_names_its_record_format_and_tpdiag(tp12):
    import tpdiag
    from tpdiag.records.store import RECORD_FORMAT

    for w in _worlds(tp12):
        d = json.loads(w.read_text())
        assert (d["record_format"], d["tpdiag"]) == (RECORD_FORMAT, tpdiag.__version__), w


def test_an_older_run_without_the_fields_is_format_1_and_refused(tp12, tmp_path):
    """world.json files from before the fields existed are format 1, whose op records were counted
    across a module's calls (records/record_index.RECORD_FORMAT): refused in one line, exit 2; the
    same run with its fields passes (the control)."""
    assert evaluate(str(tp12), _rounding(tmp_path)).exit_code == 0
    for w in _worlds(tp12):
        _json_edit(w, lambda d: (d.pop("record_format", None), d.pop("tpdiag", None)))
    res = evaluate(str(tp12), _rounding(tmp_path))
    assert res.exit_code == 2 and any("record format 1" in p for p in res.problems + [
        d.error or "" for d in res.degrees.values()]), res.lines()


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(record_format=9, tpdiag="9.0.0"), "record format 9 (written by tpdiag 9.0.0); this tpdiag"),
    # format 2 recorded an HF model's root and its `model` child under one name (records/keys.ROOT_NAMESAKE)
    (lambda d: d.update(record_format=2), "record format 2 (written by tpdiag"),
    (lambda d: d.update(record_format="1"), "record format '1'"),
    (lambda d: d.update(tpdiag="0.0.1"), "was written by tpdiag '0.0.1' but manifest.json by tpdiag"),
    (lambda d: d.pop("tpdiag"), "names a record format but no tpdiag version"),
], ids=["newer format", "older format 2", "format not an int", "another tpdiag", "version removed"])
def test_a_world_of_another_format_or_tpdiag_is_inconclusive(tp12, tmp_path, edit, words):
    """On main each of these passed the gate (exit 0): nothing read the fields."""
    import tpdiag
    from tpdiag.errors import Inconclusive

    _json_edit(tp12 / "tp2" / "world.json", edit)
    res = evaluate(str(tp12), _rounding(tmp_path))
    assert res.exit_code == 2 and any(words in p for p in res.problems + [
        d.error or "" for d in res.degrees.values()]), res.lines()
    r = _cli("gate", tp12, "--allow", "rounding")
    assert r.exit_code == 2 and words in r.output.splitlines()[0] and "Traceback" not in r.output, r.output
    r = _cli("report", tp12, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(Inconclusive, match="record format|tpdiag"):
        tpdiag.load(str(tp12))


def test_diff_refuses_a_capture_of_another_record_format(tp12, tmp_path):
    """`tpdiag diff` reads world.json through the same reader: one line, exit 2, nothing written."""
    _json_edit(tp12 / "tp2" / "world.json", lambda d: d.update(record_format=7))
    r = _cli("diff", tp12 / "tp1", tp12 / "tp2", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "record format 7" in r.output and len(r.output.strip().splitlines()) == 1, r.output
