"""manifest.json `time_breakdown` (runner/timing.py, records/timing.py): where a compare's time went."""
from __future__ import annotations

import json
import math
import shutil
import time

import pytest
from conftest import run_cli


def assert_breakdown(run_dir) -> dict:
    """The breakdown's contract: every part and total >= 0, the parts add up to no more than
    the wall time (each is rounded to the ms), the reader finds nothing wrong with it."""
    from tpdiag.records.timing import read_breakdown

    m = json.loads((run_dir / "manifest.json").read_text())
    tb = m["time_breakdown"]
    assert tb["schema"] == 1 and tb["wall_s"] > 0
    for p in tb["parts"]:
        assert p["s"] >= 0 and math.isfinite(p["s"]), p
        assert all(v >= 0 for v in (p.get("worlds") or {}).values()), p
    assert sum(p["s"] for p in tb["parts"]) <= tb["wall_s"] + 0.0005 * len(tb["parts"]), tb
    assert all(v >= 0 for v in tb["totals"].values()), tb["totals"]
    assert tb["parts"][-1]["part"] == "other"
    checked, problems = read_breakdown(m)
    assert problems == [] and checked is not None
    # every world the manifest ran is a part, with the wall time the manifest gives it
    worlds = {p["label"]: p["s"] for p in tb["parts"] if p["part"] == "world"}
    assert worlds == {k: w["wall_s"] for k, w in m["worlds"].items()}
    return tb


def test_tiny_compare_breakdown_in_manifest_and_report(tp12_run):
    tb = assert_breakdown(tp12_run)
    kinds = [p["part"] for p in tb["parts"]]
    # --no-confirm; the second pass judges the divergent modules past the first on their own inputs
    assert kinds == ["checks", "setup", "world", "world", "world", "diff", "second-pass", "other"], kinds
    assert [p["what"] for p in tb["parts"] if p["part"] == "world"] == [
        "TP=1 (reference)", "TP=1 (reference rerun)", "TP=2"]
    t = tb["totals"]
    assert t["worlds"] == 5 and t["model_build_s"] > 0  # the second pass's two worlds among them and t["steps_s"] > 0
    assert "triton_compile_s" not in t  # CPU: nothing compiles, and no zero says otherwise
    from tpdiag.reports.html import render

    html = render(str(tp12_run))
    assert 'id="time">Where the time went' in html and "TP=1 (reference rerun)" in html
    assert "model build" in html and "Timing:" not in html
    from tpdiag.cli.timing import time_lines

    lines = time_lines(json.loads((tp12_run / "manifest.json").read_text()))
    assert lines[0].startswith("time: ") and any("world: TP=2" in ln for ln in lines)
    assert any("model build" in ln for ln in lines)


BAD = [
    "fast",                                                       # not an object
    {"schema": 1, "wall_s": "NaN", "parts": []},                  # wall time not a number
    {"schema": 1, "wall_s": 1.0, "parts": [{"part": "world", "s": -3}, 7], "totals": {"steps_s": "x"}},
]


def test_malformed_breakdown_never_crashes_report_or_gate(tp12_run, tmp_path):
    from tpdiag import gate as gate_lib
    from tpdiag.cli.timing import time_lines
    from tpdiag.reports.html import render

    run = tmp_path / "run"
    shutil.copytree(tp12_run, run)
    policy = gate_lib.load_policy(None)
    before = gate_lib.evaluate(str(run), policy)
    m = json.loads((run / "manifest.json").read_text())
    for bad in BAD:
        m["time_breakdown"] = bad
        (run / "manifest.json").write_text(json.dumps(m))
        # timings are not evidence: the gate's answer does not move, the report renders and
        # says what it dropped, --verbose says so in its lines
        after = gate_lib.evaluate(str(run), policy)
        assert (after.exit_code, after.lines()) == (before.exit_code, before.lines()), bad
        html = render(str(run))
        assert "Timing: manifest.json time_breakdown" in html, bad
        assert any("time_breakdown" in ln for ln in time_lines(m)), bad
    p = run_cli("report", str(run))  # the command itself, on the last of them
    assert p.returncode == 0, p.stderr


def test_reader_keeps_the_well_formed_parts():
    from tpdiag.records.timing import read_breakdown

    tb, problems = read_breakdown({"time_breakdown": {
        "schema": 1, "wall_s": 10.0, "parts": [{"part": "world", "what": "TP=1", "s": 4.0},
                                                {"part": "world", "s": -1.0}, {"part": "nap", "s": 1.0}],
        "totals": {"model_build_s": 2.0, "float64_s": float("inf")}}})
    assert [p["s"] for p in tb["parts"]] == [4.0] and tb["totals"] == {"model_build_s": 2.0}
    assert len(problems) == 3, problems
    assert read_breakdown({}) == (None, [])
    over = {"schema": 1, "wall_s": 1.0, "parts": [{"part": "world", "what": "TP=1", "s": 5.0}]}
    assert "more than the wall time" in read_breakdown({"time_breakdown": over})[1][0]
    assert read_breakdown({"time_breakdown": {"schema": 2, "wall_s": 1.0, "parts": []}})[0] is None


def test_compile_meter_times_between_tritons_hooks():
    """Triton calls jit_cache_hook before a compile and jit_post_compile_hook after it; the meter
    adds up the seconds in between and puts back the hooks that were there."""
    pytest.importorskip("triton")
    from triton import knobs

    from tpdiag.runner.compile_time import compile_meter

    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw)
    try:
        with compile_meter("cuda") as out:
            for _ in range(2):
                assert not knobs.runtime.jit_cache_hook(key="k", repr="_lanes[num_warps=4](x: *bf16)")
                time.sleep(0.02)
                knobs.runtime.jit_post_compile_hook(key="k")
        assert out["triton_compiles"] == 2 and out["triton_compile_s"] >= 0.04, out
        assert out["triton_kernels"] == ["_lanes[num_warps=4](x: *bf16)"] * 2  # which ones compiled
        assert len(seen) == 2  # the user's hook still ran
        assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is not None
        with compile_meter("cpu") as out:
            pass
        assert out == {}  # nothing compiles on the CPU: no figure at all
    finally:
        knobs.runtime.jit_post_compile_hook = None


def test_own_input_pass_worlds_are_timed_and_linked_ones_not_counted(behind_hash_run):
    """After a hash-first pass the own-input judgement is one more pass inside the region pass
    (region/ops): summary.json times its worlds apart from the region pass's (on an H200 its
    reference was 13 of a 56 s compare, and only the region pass's worlds were reported), and the
    breakdown does not list a world it linked rather than ran as one that ran in 0 s."""
    run = behind_hash_run
    s = json.loads((run / "summary.json").read_text())
    own_m = json.loads((run / "region" / "ops" / "manifest.json").read_text())
    region_m = json.loads((run / "region" / "manifest.json").read_text())
    t = s["timings"]
    # the region pass's worlds stay where they were; the own-input pass's are its own, not theirs
    assert set(t["second_pass_worlds"]) == set(region_m["worlds"]) == {"1", "2"}
    own = t["own_pass_worlds"]
    assert set(own) == set(own_m["worlds"]) == {"1", "2"}
    ref = own["1"]
    assert ref["wall_s"] == own_m["worlds"]["1"]["wall_s"] > 0
    assert ref["steps_s"] > 0 and ref["float64_s"] > 0 and ref["model_s"] > 0 and ref["write_s"] >= 0
    assert ref != t["second_pass_worlds"]["1"]
    # TP=2 was not run again: its region folder's records stood in (runner/compare.py _linked)
    assert own["2"] == {"wall_s": 0.0, "records_from": str(run / "region" / "tp2")}, own["2"]
    assert t["own_pass_phases"] == own_m["phases"] and t["own_pass_phases"]["diff_s"] > 0
    from test_run_directory_doc import _tables, undocumented

    assert undocumented(_tables(), "summary", {"timings": t}) == []
    tb = assert_breakdown(run)
    (sp,) = [p for p in tb["parts"] if p["part"] == "second-pass"]
    walls = {f"region/{lab}": w["wall_s"] for lab, w in region_m["worlds"].items()}
    assert sp["worlds"] == {**walls, "region/ops/1": ref["wall_s"]}, sp
    assert "region/ops (TP=2 not run: an earlier pass's records)" in sp["what"], sp["what"]
    # the totals count the worlds that ran: pass 1's two, the region pass's two, the own-input reference
    assert tb["totals"]["worlds"] == 5 and tb["totals"]["float64_s"] >= ref["float64_s"]
