"""The own-input pass after a region pass (runner/drill.py: _judge_own_after_hash) runs only the
reference: its other worlds would record again exactly what the region pass's recorded, so their
folders are linked from there (runner/compare.py: records_from) - read without their op records
where the region pass also recorded ops and this pass records none. The reference itself writes
only its float64 records and reads the rest from the region reference's folder (records_base,
records/store.py). The run directory's verdict files are those of the pass that reruns every world
and writes every record (TPDIAG_OWN_PASS_RERUN=1, the control)."""
import json
import os
import sys

import pytest

from conftest import BEHIND_HASH, ROOT, run_cli

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from same_rundirs import _json_lines  # noqa: E402  (timings, hosts and paths dropped)

HASH = ("--capture", "hash", "--no-confirm", "--no-baseline", "--format", "json")
DECODE = ("--tp", "1", "--mode", "prefill,decode", "--forward-only", "--dtype", "bfloat16",
          "--batch-size", "1", "--seq-len", "16")
BEHIND = ("--model", "py:tests/models/planted/behind.py:bugs", "--tp", "1,2")
assert (*BEHIND, *HASH) == BEHIND_HASH  # the linked run of BEHIND is conftest's behind_hash_run


def _one(tmp_path, name, args, rerun, env=None):
    d = tmp_path / f"{name}-{rerun}"
    p = run_cli("compare", *args, *HASH, "--out", str(d),
                env={"OMP_NUM_THREADS": "1", "TPDIAG_OWN_PASS_RERUN": rerun, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return d


def _pair(tmp_path, name, args, env=None):
    """(linked, rerun-all) run directories of one compare."""
    return [_one(tmp_path, name, args, rerun, env) for rerun in ("0", "1")]


@pytest.fixture(scope="module")
def behind_rerun(tmp_path_factory):
    """The control of both BEHIND tests below: BEHIND with every world run again. With
    TPDIAG_OWN_PASS_RERUN=1 nothing is linked (drill.py: no records_from), so no reference reads a
    base (compare.py: _base_world is asked only for a linked reference) and TPDIAG_OWN_REF_BASE
    changes nothing: each test ran this same compare of its own."""
    return _one(tmp_path_factory.mktemp("behind-rerun"), "behind", BEHIND, "1")


def _same_verdict_files(a, b):
    for name in ("summary.json", "diff.csv", "region/summary.json", "region/ops/summary.json",
                 "region/ops/diff.csv"):
        pa, pb = str(a / name), str(b / name)
        if name.endswith(".csv"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
        else:
            assert _json_lines(pa, str(a)) == _json_lines(pb, str(b)), name


def _worlds(d):
    return json.loads((d / "region" / "ops" / "manifest.json").read_text())["worlds"]


def _kinds(folder):
    return {json.loads(line)["kind"] for line in (folder / "events.jsonl").read_text().splitlines()}


def _wrote_only_float64(d):
    """The own-input pass's reference wrote its float64 records only, its base the region reference."""
    w = _worlds(d)
    assert w["1"]["records_base"] == str(d / "region" / "tp1"), w
    assert _kinds(d / "region" / "ops" / "tp1") == {"oracle"}
    assert {"in", "out"} <= _kinds(d / "region" / "tp1")


def test_the_decode_world_is_not_run_again_and_the_verdict_is_the_same(tmp_path):
    linked, rerun = _pair(tmp_path, "decode", DECODE)
    s = json.loads((linked / "summary.json").read_text())
    d = s["configurations"]["1-decode"]
    assert d["own_inputs_hash"], d  # the downstream modules waited for the own-input pass
    w = _worlds(linked)
    assert w["1-decode"]["records_from"] == str(linked / "region" / "tp1-decode"), w
    assert w["1-decode"]["wall_s"] == 0.0 and w["1"]["wall_s"] > 0, w
    assert os.path.samefile(linked / "region" / "ops" / "tp1-decode" / "records.safetensors",
                            linked / "region" / "tp1-decode" / "records.safetensors")
    # the control ran it again
    assert "records_from" not in _worlds(rerun)["1-decode"] and _worlds(rerun)["1-decode"]["wall_s"] > 0
    _wrote_only_float64(linked)
    assert "records_base" not in _worlds(rerun)["1"] and len(_kinds(rerun / "region" / "ops" / "tp1")) > 3
    _same_verdict_files(linked, rerun)


def test_a_world_that_also_recorded_ops_is_read_without_them(behind_hash_run, behind_rerun):
    """At TP=2 the first divergence's verdict came with its ops in the region pass; the own-input
    pass records modules only: the TP=2 world's ops are left out and the rest numbered as a
    module-level world numbers them (diff.csv's idx, byte for byte the control's). The bug behind
    the first divergence is still found, judged on the TP=2 side's own inputs."""
    linked, rerun = behind_hash_run, behind_rerun  # TPDIAG_OWN_PASS_RERUN unset: "0", its default
    w = _worlds(linked)
    assert w["2"]["records_from"] == str(linked / "region" / "tp2"), w
    assert w["2"]["records_read"] == "without its op records", w
    assert "records_from" not in _worlds(rerun)["2"]
    _wrote_only_float64(linked)
    assert "records_base" not in _worlds(rerun)["1"]
    _same_verdict_files(linked, rerun)
    d = json.loads((linked / "summary.json").read_text())["degrees"]["2"]
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert kv["wv"]["cause"] == "sharding-bug" and kv["wv"]["oracle"]["own"], kv


def test_the_reference_writes_every_record_again_under_the_knob(tmp_path, behind_rerun):
    """TPDIAG_OWN_REF_BASE=0 (the A/B of records_base): the own-input pass's reference writes
    every record, the other worlds still linked; the verdict files are the same as the rerun's."""
    linked, rerun = _one(tmp_path, "knob", BEHIND, "0", env={"TPDIAG_OWN_REF_BASE": "0"}), behind_rerun
    w = _worlds(linked)
    assert "records_base" not in w["1"] and w["2"]["records_from"], w
    assert len(_kinds(linked / "region" / "ops" / "tp1")) > 3
    _same_verdict_files(linked, rerun)
