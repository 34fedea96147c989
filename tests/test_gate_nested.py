"""A run's own passes gated alone (red team hred22). The second pass (RUN/ops), a confirmation's rerun
(RUN/confirm/FIX), a fix chain's round and a matrix variant are whole run directories by their files, so
`tpdiag gate RUN/ops --allow rounding` judged the float64 pass of a few modules as if it were the user's
run: exit 0 on main (d1795347), as did a symlink to it and a copy of it moved out of its run. Each is now
inconclusive (exit 2) with one line naming the run to gate; the run itself is gated as before (the
negative control). Reads conftest's tp12_run (TP=1,2, rounding only), edits copies."""
import os
import shutil

from conftest import run_cli

from tpdiag.gate import evaluate, load_policy, with_allowed


def _rounding():
    return with_allowed(load_policy(None), "rounding")


def test_gate_refuses_a_runs_second_pass_folder(tp12_run):
    assert (tp12_run / "ops" / "manifest.json").is_file()
    # the run itself: rounding only, a pass under --allow rounding (the control)
    assert evaluate(str(tp12_run), _rounding()).exit_code == 0
    res = evaluate(str(tp12_run / "ops"), _rounding())
    assert res.exit_code == 2 and res.problems, res.problems
    assert f"the run {tp12_run}" in res.problems[0] and "second pass ops/" in res.problems[0]
    g = run_cli("gate", str(tp12_run / "ops"), "--allow", "rounding")
    assert g.returncode == 2, g.stdout + g.stderr
    assert "Traceback" not in g.stdout + g.stderr
    assert f"gate the run: tpdiag gate {tp12_run}" in g.stdout


def test_report_of_a_runs_second_pass_writes_its_page_and_exits_2(tp12_run, tmp_path):
    """`tpdiag report RUN/ops` exited 0 with the float64 pass's page as if it were a run's verdict."""
    page = tmp_path / "ops.html"
    r = run_cli("report", str(tp12_run / "ops"), "-o", str(page))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and page.is_file()
    assert f"report the run: tpdiag report {tp12_run}" in r.stdout + r.stderr, r.stdout + r.stderr
    ok = run_cli("report", str(tp12_run), "-o", str(tmp_path / "run.html"))  # the run itself (the control)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_gate_refuses_a_symlink_to_a_pass_and_a_pass_copied_out(tp12_run, tmp_path):
    link = tmp_path / "looks-like-a-run"
    os.symlink(tp12_run / "ops", link)
    res = evaluate(str(link), _rounding())
    assert res.exit_code == 2 and "second pass ops/" in res.problems[0], res.problems
    # moved out of its run, the pass's own manifest says what it is: a float64 oracle and no self-check
    # that only tpdiag's passes set (config.RerunSpec)
    copy = tmp_path / "copied"
    shutil.copytree(tp12_run / "ops", copy, symlinks=True)
    res = evaluate(str(copy), _rounding())
    assert res.exit_code == 2 and "only a pass tpdiag runs inside a run sets" in res.problems[0], res.problems
    # a user's run that merely lives under a folder named like a pass is not one: no run around it
    plain = tmp_path / "confirm" / "mine"
    shutil.copytree(tp12_run, plain, symlinks=True)
    assert evaluate(str(plain), _rounding()).exit_code == 0


def test_a_fix_chain_round_alone_and_a_round_removed(auto_run, tmp_path):
    """auto/round1/ gated alone is refused like any pass; a round the chain lists, removed, is inconclusive for
    `tpdiag report` as for the gate (the report wrote its page and exited 0 on main)."""
    assert (auto_run / "auto" / "round1" / "manifest.json").is_file()
    res = evaluate(str(auto_run / "auto" / "round1"), _rounding())
    assert res.exit_code == 2 and "fix chain round auto/round1/" in res.problems[0], res.problems
    run = tmp_path / "run"
    shutil.copytree(auto_run, run, symlinks=True)
    page = tmp_path / "r.html"
    ok = run_cli("report", str(run), "-o", str(page))
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the control: the run as made
    shutil.rmtree(run / "auto" / "round1")
    assert evaluate(str(run), _rounding()).exit_code == 2
    r = run_cli("report", str(run), "-o", str(page))
    assert r.returncode == 2 and "fix chain's round 1" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
