"""Fail closed, round 5 (a red-team review): forged runs that passed the gate on main (d29cc60), each now
inconclusive (exit 2) with one line naming what is wrong. The forger here uses tpdiag's own code to make
diff.csv and summary.json agree with the records (diff/recheck.recomputed), so only the new checks stand
between the forgery and a pass:

- tp1/'s world.json, events.jsonl and records.safetensors copied over tp2/ (the second pass removed):
  a divergent TP=1,2 run read "bitwise" under the default policy (exit 0);
- a `--fix all` run (bitwise) whose manifest.json says no fix ran: the stock model read bitwise (exit 0);
- a configuration cut from manifest.json's labels while its config still runs it; a world another compare of
  the same settings wrote, copied in (read as this run's: exit 1 like the run itself);
- a `--steps 2` run with step 1's records cut from both worlds (n_records edited to match): a BUG only
  step 1 shows (exit 4) passed `--allow rounding` (exit 0);
- the directory `tpdiag diff RUN/tp2 RUN/tp2` writes (a run against itself: "bitwise") passed the gate; so
  did a diff of a run and a byte copy of it;
- a `--fix auto` run with `fix_chain` removed from summary.json: its later rounds, gated as the user's run
  (exit 1 under a policy allowing round 0's cause alone), went ungated (exit 0).

Edits are made to copies of conftest's session runs (tp12_run, fixall12_run, and test_steps' TP=1,2 --steps 2
run of tests/models/planted/step_stale.py:stale_reduce, shared by name) and of one forward-only `--fix auto` compare of its own.
"""
import json
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy
from tpdiag.gate.policy import with_allowed


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _reforge(run, lab="2", ref="1"):
    """What a forger does after editing records: diff.csv and summary.json's numbers re-derived from the
    records with tpdiag's own code, the verdict made what they give, the second pass removed."""
    from tpdiag.diff.analyse import write_csv
    from tpdiag.diff.recheck import recomputed
    from tpdiag.records.store import RecordSet

    dd, got = recomputed(RecordSet(str(run / f"tp{ref}")), RecordSet(str(run / f"tp{lab}")), lab)
    write_csv(str(run / "diff.csv"), dd.rows)
    bitwise = all(r["bitwise"] and r.get("rank_consistent") is not False for r in dd.rows)

    def edit(s):
        e = s["degrees"][lab]
        e.update({k: v for k, v in got.items() if v is not None or k in e})
        e["findings"] = [f for f in e.get("findings") or () if f.get("key") in {r["key"] for r in dd.rows}]
        e.pop("downstream_unjudged", None)
        s.pop("second_pass", None)
        if bitwise:
            s["status"] = e["status"] = "bitwise"
            e.update(first_divergence=None, findings=[], own_inputs=[])
            s["class"] = e["class"] = None
        else:
            (e.get("first_divergence") or {}).pop("second_pass_dir", None)
        from tpdiag.diff.classes import add_classes

        add_classes(s)  # the classes too are what the edited findings give (the gate re-derives them)
    _json_edit(run / "summary.json", edit)
    for name in ("ops", "region"):
        shutil.rmtree(run / name, ignore_errors=True)


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    return dst


def test_the_untouched_runs_are_judged_as_before(tp12, fixall12_run):
    assert evaluate(str(tp12), load_policy(None)).exit_code == 1  # rounding: fails the default policy
    assert evaluate(str(tp12), with_allowed(load_policy(None), "rounding")).exit_code == 0
    assert evaluate(str(fixall12_run), load_policy(None)).exit_code == 0  # bitwise


def test_the_reference_s_records_copied_over_a_degree_are_inconclusive(tp12):
    for name in ("world.json", "events.jsonl", "records.safetensors"):
        shutil.copy(tp12 / "tp1" / name, tp12 / "tp2" / name)
    _reforge(tp12)
    assert json.loads((tp12 / "summary.json").read_text())["status"] == "bitwise"  # the forgery is complete
    res = evaluate(str(tp12), load_policy(None))
    assert res.exit_code == 2, res.lines()
    assert "tp2/world.json is the world of degree 1" in res.problems[0], res.problems
    r = _cli("report", tp12, "-o", tp12.parent / "r.html")
    assert r.exit_code == 2 and "world of degree 1" in r.output, r.output


def test_a_world_of_another_compare_is_inconclusive(tp12, stock_run):
    """conftest's TP=1,2,4,8 compare ran the same model and settings: its tp2/ re-diffs to this run's
    diff.csv exactly (exit 1 on main, as the untouched run), but it is another run's evidence."""
    shutil.rmtree(tp12 / "tp2")
    shutil.copytree(stock_run / "tp2", tp12 / "tp2")
    res = evaluate(str(tp12), load_policy(None))
    assert res.exit_code == 2 and "by another compare than this run's" in res.problems[0], res.lines()


def _no_fixes(run, summary_too):
    def edit(d):
        d["fixes"] = []
        d["config"].update(fixes=[], fix_mode="none")
    _json_edit(run / "manifest.json", edit)
    if summary_too:
        _json_edit(run / "summary.json", lambda s: s.pop("fixes", None))


@pytest.mark.parametrize("summary_too,words", [(False, "summary.json says the fixes"),
                                                (True, "tp1/world.json ran fixes")])
def test_a_fixed_run_relabelled_as_the_stock_model_is_inconclusive(fixall12_run, tmp_path, summary_too, words):
    run = tmp_path / "run"
    shutil.copytree(fixall12_run, run, symlinks=True)
    _no_fixes(run, summary_too)
    res = evaluate(str(run), load_policy(None))
    assert res.exit_code == 2 and words in res.problems[0], res.lines()


def test_a_configuration_its_config_runs_cut_from_the_labels_is_inconclusive(tp12):
    _json_edit(tp12 / "manifest.json", lambda d: d["config"].update(degrees=[1, 2, 4]))
    res = evaluate(str(tp12), with_allowed(load_policy(None), "rounding"))
    assert res.exit_code == 2 and "its config runs 1, 2, 4" in " ".join(res.problems), res.problems


@pytest.fixture(scope="module")
def steps2_run(tmp_path_factory):
    from conftest import run_cli, shared_run

    def make(out):  # test_steps' run, shared by name under xdist: a BUG only step 1 shows
        p = run_cli("compare", "--model", "py:tests/models/planted/step_stale.py:stale_reduce", "--tp", "1,2",
                    "--steps", "2", "--no-confirm", "--no-baseline", "--out", str(out), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-2000:]
    return shared_run(tmp_path_factory, "steps2-stale_reduce", make)


def test_a_step_cut_from_both_worlds_is_inconclusive(steps2_run, tmp_path, monkeypatch):
    from tpdiag.records import store

    run = tmp_path / "run"
    shutil.copytree(steps2_run, run, symlinks=True)
    rounding = with_allowed(load_policy(None), "rounding")
    assert evaluate(str(run), rounding).exit_code != 0  # the control: step 1 holds what the policy fails
    for lab in ("1", "2"):
        events = [json.loads(x) for x in (run / f"tp{lab}" / "events.jsonl").read_text().splitlines()]
        events = [m for m in events if m["step"] == 0]
        (run / f"tp{lab}" / "events.jsonl").write_text("".join(json.dumps(m) + "\n" for m in events))
        _json_edit(run / f"tp{lab}" / "world.json", lambda d: d.update(n_records=len(events)))
    with monkeypatch.context() as m:
        m.setattr(store, "check_steps", lambda *a: None)  # the forger's tpdiag: main's
        from tpdiag.records import completeness

        # (a step cut has no backward records either, and its tensors stay in the file)
        m.setattr(completeness, "backward_ran", lambda *a: None)
        m.setattr(completeness, "orphan_tensors", lambda *a: None)
        from tpdiag.records import labels

        # main's had no check that a rounding label without a bound names its second pass either (hred13):
        # the rebuilt summary.json names none
        m.setattr(labels, "unjudged_problems", lambda *a: [])
        _reforge(run)
        assert evaluate(str(run), rounding).exit_code == 0  # the forgery passed main's gate
    res = evaluate(str(run), rounding)
    assert res.exit_code == 2 and "no record of step 1" in " ".join(res.problems), res.lines()


# -- tpdiag diff: two runs, not one twice ---------------------------------------------------------
def test_the_gate_of_a_diff_of_a_run_against_itself_is_inconclusive(tp12_run, tmp_path):
    """`tpdiag diff A A` still says what it computed (bitwise: test_capture's sanity check), but its
    directory is no evidence of anything: the gate and the report call it inconclusive."""
    d = tmp_path / "d"
    r = _cli("diff", tp12_run / "tp2", f"{tp12_run / 'tp2'}/", "--out", d)
    assert r.exit_code == 0, r.output
    res = evaluate(str(d), load_policy(None))
    assert res.exit_code == 2 and "both sides of this tpdiag diff are" in res.problems[0], res.lines()
    r = _cli("report", d, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "a run diffed against itself" in r.output, r.output


def test_a_diff_of_one_run_twice_is_inconclusive(tp12_run, tmp_path):
    """What `tpdiag diff RUN/tp2 RUN/tp2` wrote on main: made here from a diff of a copy, the copy's entry
    then pointed at the run itself (the records re-diff to the same rows: only the check of the sides says)."""
    d, copy = tmp_path / "d", tmp_path / "copy" / "tp2"
    shutil.copytree(tp12_run / "tp2", copy)
    r = _cli("diff", tp12_run / "tp2", copy, "--out", d)
    assert r.exit_code == 0, r.output
    _json_edit(d / "manifest.json", lambda m: m["runs"].update({m["labels"][1]: m["runs"][m["labels"][0]]}))
    shutil.rmtree(copy)
    res = evaluate(str(d), load_policy(None))
    assert res.exit_code == 2 and "both sides of this tpdiag diff are" in res.problems[0], res.lines()
    r = _cli("report", d, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "both sides" in r.output, r.output


def test_a_diff_of_two_degrees_is_judged(tp12_run, tmp_path):
    d = tmp_path / "d"
    r = _cli("diff", tp12_run / "tp1", tp12_run / "tp2", "--out", d)
    assert r.exit_code == 0, r.output
    assert evaluate(str(d), with_allowed(load_policy(None), "rounding")).exit_code == 0  # the control
    assert evaluate(str(d), load_policy(None)).exit_code == 1


def test_a_diff_of_a_run_and_its_copy_is_inconclusive(tp12_run, tmp_path):
    copy = tmp_path / "copy" / "tp2"
    shutil.copytree(tp12_run / "tp2", copy)
    d = tmp_path / "d"
    r = _cli("diff", tp12_run / "tp2", copy, "--out", d)
    assert r.exit_code == 0, r.output
    res = evaluate(str(d), load_policy(None))
    assert res.exit_code == 2 and "copies of one run" in res.problems[0], res.lines()


# -- --fix auto: every round the compare ran is gated ----------------------------------------------
def _round0_cause(run, tmp_path):
    """A policy allowing round 0's cause alone: a later round's other cause fails it (gated as the user's run)."""
    s = json.loads((run / "summary.json").read_text())
    p = tmp_path / "round0.toml"
    p.write_text(f'allow_causes = ["{s["degrees"]["2"]["first_divergence"]["cause"]}"]\n')
    return load_policy(str(p))


@pytest.mark.parametrize("cut", ["fix_chain removed", "fix_chain cut to round 0", "chain and rounds removed"])
def test_a_fix_chain_cut_from_the_summary_is_inconclusive(auto_run, tmp_path, cut):
    run = tmp_path / "run"
    shutil.copytree(auto_run, run, symlinks=True)
    policy = _round0_cause(run, tmp_path)
    chain = json.loads((run / "summary.json").read_text())["fix_chain"]
    assert len(chain) > 1 and json.loads((run / "manifest.json").read_text())["fix_chain_rounds"] == len(chain)
    assert evaluate(str(run), policy).exit_code == 1  # the control: a later round's cause is not allowed
    if cut == "fix_chain cut to round 0":
        _json_edit(run / "summary.json", lambda s: s.update(fix_chain=s["fix_chain"][:1]))
    else:
        _json_edit(run / "summary.json", lambda s: s.pop("fix_chain"))
    if cut == "chain and rounds removed":
        shutil.rmtree(run / "auto")
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and "fix chain" in res.problems[0], res.lines()


def test_a_round_of_the_chain_copied_over_another_is_inconclusive(auto_run, tmp_path):
    """Red team hred10: a later round's folder was gated as its own run, never tied to the chain: the
    last round (bitwise) copied over round 1 (the cause round 0's policy does not allow) passed the gate
    (exit 0, the control exit 1). Each round's manifest must be this run's auto/roundN/, with the fixes
    summary.json's fix_chain says that round ran."""
    run = tmp_path / "run"
    shutil.copytree(auto_run, run, symlinks=True)
    policy = _round0_cause(run, tmp_path)
    chain = json.loads((run / "summary.json").read_text())["fix_chain"]
    assert len(chain) > 2 and chain[-1]["status"] == "bitwise", chain
    assert evaluate(str(run), policy).exit_code == 1  # the control
    shutil.rmtree(run / "auto" / "round1")
    shutil.copytree(run / "auto" / f"round{len(chain) - 1}", run / "auto" / "round1", symlinks=True)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and any("the fix chain's round 1: auto/round1/manifest.json was written into" in p
                                      for p in res.problems), res.lines()
