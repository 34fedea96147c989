"""Fail closed, red team hred10: the confirmation's run folder (RUN/confirm/<fix>/) is this run's, and a
confirmation that ran is in summary.json.

The confirmation was re-derived from its own folder (its records re-read and re-diffed), but nothing tied
that folder to the run: another run's confirm/<fix>/ copied in (another location, another seed) agrees
with itself and passed `gate --allow rounding` (exit 0) as this run's confirmation. Its manifest must now
have been written into this run's folder (or, after `tpdiag confirm` on a run directory moved since, into
the folder it is read from), with this run's settings and the confirming fix on top of its fixes, started
after the run.

A confirmation removed from summary.json (the entry set to null, made `no-fix`, or its folder's name
dropped with the verdict made `not-confirmed`) passed too: with it goes the bug only its rerun found
(runner/confirm._bug_after). A compare run with --confirm confirms every divergent configuration, a
`no-fix` is said only where no fix removes the cause, and a confirm/<fix>/ folder of this run is named
by the configuration it confirmed.

One real compare (tiny-llama, TP=1,2 forward only, with its confirmation) per module; each case edits a
copy. A second source, `tpdiag confirm` on a copy moved elsewhere and named by a relative path, is both
the control (a confirmation written into a moved run directory passes) and another run's confirmation.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli
from typer.testing import CliRunner

from tpdiag.errors import Inconclusive
from tpdiag.gate import evaluate, load_policy, with_allowed

FIX = "tp-invariant-linear"


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture(scope="module")
def confirmed(confirmed12_run):
    assert (confirmed12_run / "confirm" / FIX).is_dir()
    return confirmed12_run


def _this_checkout_from(cwd) -> dict | None:
    """None where a process started in `cwd` with this environment imports this checkout's tpdiag,
    else the PYTHONPATH that makes it (find_spec: the package located, not imported)."""
    code = "import importlib.util as u; s = u.find_spec('tpdiag'); print(s.origin if s else '')"
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    if p.stdout.strip() and os.path.samefile(p.stdout.strip(), os.path.join(ROOT, "tpdiag", "__init__.py")):
        return None
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def reconfirmed(confirmed, tmp_path_factory):
    """A copy of the run moved elsewhere, its confirmation run again there by `tpdiag confirm` (a relative
    path): its confirm/<fix>/ says it was written into `moved/confirm/<fix>`, not where the run began."""
    base = tmp_path_factory.mktemp("moved")
    shutil.copytree(confirmed, base / "moved", symlinks=True)
    shutil.rmtree(base / "moved" / "confirm")
    s = json.loads((base / "moved" / "summary.json").read_text())
    s["degrees"]["2"]["confirmation"] = None
    (base / "moved" / "summary.json").write_text(json.dumps(s))
    # from the moved run's parent: through the tests' CLI server where a process started there imports
    # this checkout's tpdiag as it is (PYTHONPATH, an editable install), else a fresh interpreter given
    # PYTHONPATH=ROOT (a start-up variable of its own)
    p = run_cli("confirm", "moved", cwd=base, env=_this_checkout_from(base))
    assert p.returncode == 0, p.stderr[-3000:]
    return base / "moved"


@pytest.fixture()
def run(confirmed, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(confirmed, dst, symlinks=True)
    return dst


def _summary(fn):
    def edit(r, _):
        p = r / "summary.json"
        d = json.loads(p.read_text())
        fn(d["degrees"]["2"])
        p.write_text(json.dumps(d))
    return edit


def _other_runs(r, other):
    shutil.rmtree(r / "confirm")
    shutil.copytree(other / "confirm", r / "confirm", symlinks=True)


def _removed_with_folder(r, other):
    _summary(lambda e: e.update(confirmation=None))(r, other)
    shutil.rmtree(r / "confirm")


def _unnamed(e):
    e["confirmation"].pop("run_dir")
    e["confirmation"]["verdict"] = "not-confirmed"


def _started_earlier(r, _):
    p = r / "confirm" / FIX / "manifest.json"
    d = json.loads(p.read_text())
    d["started"] = "2001-01-01T00:00:00+0000"
    p.write_text(json.dumps(d))


EDITS = {
    "another run's confirm/ copied in": (_other_runs, "another run's pass copied in"),
    "confirmation removed": (_summary(lambda e: e.update(confirmation=None)), "TP=2 has no confirmation"),
    "confirmation and its folder removed": (_removed_with_folder, "TP=2 has no confirmation"),
    "confirmation made no-fix": (_summary(lambda e: e["confirmation"].update(verdict="no-fix")),
                                 f"says no-fix, but {FIX} removes its cause"),
    "folder unnamed, not-confirmed": (_summary(_unnamed), f"confirm/{FIX}/ holds a confirmation rerun of this run"),
    "confirm/ started before the run": (_started_earlier, "before this run did"),
}


def test_the_untouched_run_and_a_confirmation_written_after_a_move_pass(confirmed, reconfirmed, tmp_path):
    res = evaluate(str(confirmed), _rounding())
    assert res.exit_code == 0, res.lines()  # the control: each edit below starts from a pass
    e = json.loads((reconfirmed / "summary.json").read_text())["degrees"]["2"]
    assert e["confirmation"]["verdict"] == "confirmed", e["confirmation"]
    assert json.loads((reconfirmed / "confirm" / FIX / "manifest.json").read_text())["config"]["out"] == \
        os.path.join("moved", "confirm", FIX)
    res = evaluate(str(reconfirmed), _rounding())
    assert res.exit_code == 0, res.lines()


@pytest.mark.parametrize("case", list(EDITS))
def test_a_confirmation_not_this_run_s_or_removed_is_inconclusive(run, reconfirmed, case):
    edit, words = EDITS[case]
    edit(run, reconfirmed)
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert any(words in p for p in res.problems), (case, res.problems)


def test_report_and_load_say_so(run, reconfirmed, tmp_path):
    import tpdiag

    _other_runs(run, reconfirmed)
    r = _cli("report", run, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "evidence disagrees" in r.output and "Traceback" not in r.output, r.output
    top = (tmp_path / "r.html").read_text()
    assert 'badge inconclusive">inconclusive' in top[:top.index('id="verdict"') + 400]
    with pytest.raises(Inconclusive, match="another run's pass copied in"):
        tpdiag.load(str(run))
