"""Two captures of one deterministic step are two runs, never "copies of one run".

`tpdiag diff` refuses two sides whose world.json are byte for byte the same (a run diffed against
its copy is bitwise whatever it holds: records/diff_sides.py). A capture's world.json differed from
another capture's of the same step only by its millisecond timings, so now and then two real
captures read as copies and the gate said inconclusive (exit 2) - seen in the suite, test_fuzz's
fixture at 7e1994f. Each capture names itself now (world.json capture_id)."""
import json

from test_faults_more import make_capture, write_targets


def test_two_captures_with_the_same_timings_are_still_two_runs(tmp_path):
    from tpdiag.diff.runs import diff_runs
    from tpdiag.gate import evaluate

    targets = write_targets(tmp_path)
    make_capture(tmp_path / "A", targets)
    make_capture(tmp_path / "B", targets)
    a, b = (json.loads((tmp_path / x / "world.json").read_text()) for x in ("A", "B"))
    assert a["capture_id"] != b["capture_id"]
    b["timings"] = a["timings"]  # what the clock gave both now and then
    (tmp_path / "B" / "world.json").write_text(json.dumps(b, indent=2))
    diff_runs(str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "AB"))
    r = evaluate(str(tmp_path / "AB"))
    assert r.exit_code == 0, r.problems
    # negative control: a real copy (world.json the same bytes) is still refused
    import shutil

    shutil.copytree(tmp_path / "A", tmp_path / "A2")
    diff_runs(str(tmp_path / "A"), str(tmp_path / "A2"), str(tmp_path / "AA"))
    r = evaluate(str(tmp_path / "AA"))
    assert r.exit_code == 2 and any("copies of one run" in p for p in r.problems), r.problems
