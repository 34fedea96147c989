"""`tpdiag confirm` refuses, in one line and before any rerun, a run directory it would misread and
then write into (records/confirmable.py): a summary.json of another schema (another tpdiag's run)
and an interrupted compare, whose summary.json is an earlier run's. Both reran the degrees as if
the summary were this run's and exited 0. Reads a copy of the shared tp12 run; no world."""
import json
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.cli import app

runner = CliRunner()


def _edit(path, name, change):
    doc = json.loads((path / name).read_text())
    change(doc)
    (path / name).write_text(json.dumps(doc))


@pytest.mark.parametrize("name,change,needle", [
    ("summary.json", lambda d: d.update(schema=99), "summary.json schema 99: this tpdiag reads schema 1"),
    ("manifest.json", lambda d: d.pop("status"), "incomplete run - the compare did not finish"),
])
def test_confirm_refuses_a_run_it_would_misread(tp12_run, tmp_path, name, change, needle):
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run, symlinks=True)
    _edit(run, name, change)
    before = (run / "summary.json").read_bytes()
    r = runner.invoke(app, ["confirm", str(run)])
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    assert (run / "summary.json").read_bytes() == before and not (run / "confirm").exists()
