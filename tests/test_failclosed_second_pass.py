"""Fail closed, round 6 (red team hred9): the second pass's record files, and manifest.json's status.

The second pass (RUN/ops/) is where the float64 verdicts and the findings only it makes come from, but
only its JSON files were checked: its worlds' events.jsonl and records.safetensors were never opened.
A tensor file truncated by a crashed copy, or another world's records in place of its own (ops/tp1's
copied over ops/tp2's, a tensor file symlinked to another world's), passed `gate --allow rounding`
(exit 0) and the report rendered the run as judged. Now each second-pass world's record index is read
and every stored record's dtype and shape checked against the file's header (no tensor bytes read):
inconclusive, exit 2.

manifest.json's `status` (compare's last write, the summary's status told again) edited to another
verdict than summary.json's also passed (exit 0) and reported cleanly: now the evidence disagrees.

Edits are made to copies of conftest's session run tp12_run (tiny-llama at TP=1,2, with its ops/ pass).
"""
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.errors import Inconclusive
from tpdiag.gate import evaluate, load_policy, with_allowed


def _cli(*args):
    from tpdiag.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    assert (dst / "ops" / "tp2" / "records.safetensors").is_file()  # the run has a second pass to edit
    return dst


def _truncated(r):
    p = r / "ops" / "tp2" / "records.safetensors"
    os.truncate(p, os.path.getsize(p) // 2)


def _records_of(src):
    def edit(r):
        for name in ("events.jsonl", "records.safetensors"):
            shutil.copy(r / "ops" / src / name, r / "ops" / "tp2" / name)
    return edit


def _tensors_linked_to(src):
    def edit(r):
        p = r / "ops" / "tp2" / "records.safetensors"
        p.unlink()
        p.symlink_to(os.path.relpath(r / "ops" / src / "records.safetensors", p.parent))  # inside the pass: allowed
    return edit


def _manifest_status(r):
    p = r / "manifest.json"
    d = json.loads(p.read_text())
    assert d["status"] == "divergent"
    d["status"] = "bitwise"
    p.write_text(json.dumps(d))


EDITS = {
    "ops/tp2 tensors truncated": (_truncated, "truncated"),
    "ops/tp2 records are ops/tp1's": (_records_of("tp1"), "world 1 but world.json says degree 2"),
    "ops/tp2 tensors linked to ops/tp1's": (_tensors_linked_to("tp1"), "its index says"),
    "manifest status bitwise": (_manifest_status, "manifest.json says the run is 'bitwise' but summary.json says"),
}


def test_the_untouched_copy_passes_allowing_rounding(tp12):
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 0, res.lines()  # the control: each edit below starts from a pass


@pytest.mark.parametrize("case", list(EDITS))
def test_an_edit_is_inconclusive_for_gate_and_load(tp12, case):
    import tpdiag

    edit, words = EDITS[case]
    edit(tp12)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert any(words in p for p in res.problems), (case, res.problems)
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(tp12))


def test_the_report_and_gate_json_say_so(tp12, tmp_path):
    _records_of("tp1")(tp12)
    r = _cli("report", tp12, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "evidence disagrees" in r.output and "Traceback" not in r.output, r.output
    top = (tmp_path / "r.html").read_text()
    top = top[:top.index('id="verdict"') + 400]
    assert 'badge inconclusive">inconclusive' in top and "the second pass in ops/" in top, top[-600:]
    r = _cli("gate", tp12, "--allow", "rounding", "--format", "json")
    assert r.exit_code == 2, r.output
    d = json.loads(r.output)
    assert d["status"] == "inconclusive" and any("the second pass in ops/" in p for p in d["problems"]), d
