"""A rerun copied out of its run is no run to gate (helper hrerun25). A compare's confirmation rerun
(confirm/<fix>/), its `--fix auto` rounds (auto/round<i>/) and a matrix's variants (variants/<slug>/) are
whole run directories by their files, run with fixes the user did not choose (or, a variant, without the
second pass). Inside their run the gate refuses them (records/nested.part_of_run, test_gate_nested.py);
copied out, a confirmation rerun's folder passed `tpdiag gate COPY --allow rounding` (exit 0) on main
958380df: its manifest holds no RerunSpec field but the defaults. Each now records its folder
(config.RerunSpec.pass_of, in manifest.json and every world.json): gate and report say inconclusive (exit
2) naming the run to gate, `tpdiag diff` refuses its worlds, and the marker edited out of the manifest is
a world.json that disagrees with it. The runs themselves gate as before (the controls)."""
import json
import shutil

import pytest

from conftest import run_cli, shared_run

from tpdiag.gate import evaluate, load_policy, with_allowed

FIX = "tp-invariant-linear"


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory):
    """A forward-only matrix of stock and fix:all at TP=1,2: stock is the primary (the top's records)."""
    def make(out):
        p = run_cli("compare", "--tp", "1,2", "--variants", "stock,fix:all", "--forward-only", "--no-confirm",
                    "--no-baseline", "--out", str(out), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-2000:]
    return shared_run(tmp_path_factory, "tp12-matrix-fwd", make)


# (fixture, the rerun's folder below its run, what the line calls it)
KINDS = {"confirmation": ("confirmed12_run", f"confirm/{FIX}", "confirmation rerun"),
         "fix chain round": ("auto_run", "auto/round1", "fix chain round"),
         "matrix variant": ("matrix_run", "variants/fix-all", "matrix variant"),
         "primary variant": ("matrix_run", "variants/stock", "matrix variant")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rerun_copied_out_is_refused_by_gate_report_and_diff(kind, request, tmp_path):
    fixture, below, what = KINDS[kind]
    run = request.getfixturevalue(fixture)
    # the control: the run itself gates as before
    assert evaluate(str(run), _rounding()).exit_code == 0
    copy = tmp_path / "looks-like-a-run"
    shutil.copytree(run / below, copy, symlinks=True)
    res = evaluate(str(copy), _rounding())
    assert res.exit_code == 2 and len(res.problems) == 1, res.problems
    assert f"the {what} {below}/ of the run {run}, moved or copied out of it" in res.problems[0], res.problems
    g = run_cli("gate", str(copy), "--allow", "rounding")
    assert g.returncode == 2 and "Traceback" not in g.stdout + g.stderr, g.stdout + g.stderr
    assert f"gate the run: tpdiag gate {run}" in g.stdout, g.stdout
    r = run_cli("report", str(copy), "-o", str(tmp_path / "page.html"))
    assert r.returncode == 2 and f"report the run: tpdiag report {run}" in r.stdout + r.stderr, r.stdout + r.stderr
    # its worlds are not the user's run's either, for a diff across machines
    d = run_cli("diff", str(copy / "tp1"), str(copy / "tp2"), "--out", str(tmp_path / "d"))
    assert d.returncode == 2 and "Traceback" not in d.stdout + d.stderr, d.stdout + d.stderr
    assert f"a world of the {what} {below}/ of the run {run}" in d.stdout + d.stderr, d.stdout + d.stderr
    assert not (tmp_path / "d").exists()


def test_the_marker_edited_out_of_the_manifest_is_tampering(confirmed12_run, tmp_path):
    """Deleted from the copy's manifest.json, the marker is still each world.json's: an edited run (exit 2),
    never the user's run that passes; set to '' in one world.json inside the run, the run's confirmation is
    not believed either."""
    copy = tmp_path / "copy"
    shutil.copytree(confirmed12_run / "confirm" / FIX, copy, symlinks=True)
    m = json.loads((copy / "manifest.json").read_text())
    assert m["config"].pop("pass_of") == f"confirm/{FIX}"
    (copy / "manifest.json").write_text(json.dumps(m))
    res = evaluate(str(copy), _rounding())
    assert res.exit_code == 2, res.problems
    assert any(f"tp1/world.json ran pass_of 'confirm/{FIX}' but manifest.json says ''" in p
               for p in res.problems), res.problems
    run = tmp_path / "run"
    shutil.copytree(confirmed12_run, run, symlinks=True)
    w = run / "confirm" / FIX / "tp2" / "world.json"
    world = json.loads(w.read_text())
    world["config"]["pass_of"] = ""
    w.write_text(json.dumps(world))
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and any("tp2/world.json ran pass_of ''" in p for p in res.problems), res.problems


def test_the_matrix_top_and_a_user_run_s_worlds_still_gate_and_diff(matrix_run, confirmed12_run, tmp_path):
    """The matrix top holds its primary variant's manifest and worlds (marked variants/stock): it is the
    user's run - it gates, and its worlds diff; a user's run's worlds diff as before."""
    assert json.loads((matrix_run / "manifest.json").read_text())["config"]["pass_of"] == "variants/stock"
    assert evaluate(str(matrix_run), _rounding()).exit_code == 0
    for run in (matrix_run, confirmed12_run):
        out = tmp_path / run.parent.name
        d = run_cli("diff", str(run / "tp1"), str(run / "tp2"), "--out", str(out))
        assert d.returncode == 0 and (out / "summary.json").is_file(), d.stdout + d.stderr
