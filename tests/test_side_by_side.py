"""The reference and its rerun side by side (runner/side_by_side.py): when they may be, and that
running them at once - two real gloo worlds - gives the records one after the other gives, leaves
this process's environment as it was, and runs a rerun that failed beside the reference again."""
from __future__ import annotations

import os

import torch

from tpdiag.config import CompareConfig
from tpdiag.records.paths import RunDir
from tpdiag.runner import side_by_side


def _pair(tmp_path, **axes):
    cfg = CompareConfig.of(degrees=(1, 2), batch_size=1, seq_len=8, **axes)
    point = cfg.worlds()[0].point
    run = RunDir(str(tmp_path))
    ref = cfg.world(point, "1", run.world("1"), "cpu", reference=True)
    base = cfg.world(point.with_(repeat="base"), "1-base", run.world("1-base"), "cpu", ref_dir=run.world("1"))
    return ref, base


def test_side_gpu_refuses_where_the_rerun_reads_the_reference(tmp_path, monkeypatch):
    ref, base = _pair(tmp_path)
    assert side_by_side.side_gpu("cpu", ref, base) == 0  # no GPUs: one after the other
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    props = type("P", (), {"name": "H", "major": 9, "minor": 0, "total_memory": 1, "multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert side_by_side.side_gpu("cuda", ref, base) == 1
    monkeypatch.setenv("TPDIAG_SIDE_BY_SIDE", "0")
    assert side_by_side.side_gpu("cuda", ref, base) == 0
    monkeypatch.delenv("TPDIAG_SIDE_BY_SIDE")
    # decode and micro-batch worlds place their pieces by the reference's shapes: they wait for it
    from dataclasses import replace

    assert side_by_side.side_gpu("cuda", ref, replace(base, point=replace(base.point, micro_batch=1))) == 0
    assert side_by_side.side_gpu("cuda", ref, replace(base, point=replace(base.point, mode="decode"))) == 0
    other = type("P", (), {"name": "A", "major": 8, "minor": 0, "total_memory": 1, "multi_processor_count": 108})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 0 else other)
    assert side_by_side.side_gpu("cuda", ref, base) == 0  # two kinds of GPU: never side by side


def test_run_pair_gives_the_sequential_records_and_restores_the_environment(tmp_path, monkeypatch):
    ref, base = _pair(tmp_path)
    before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONSAFEPATH", "TPDIAG_SET_PYTHONSAFEPATH")}
    a, b, offset = side_by_side.run_pair(ref, base, 120.0, None, 1)
    assert (a.status, b.status, offset) == ("ok", "ok", 1), (a.error, b.error)
    assert {k: os.environ.get(k) for k in before} == before
    from tpdiag.records.store import read_index

    _, ea = read_index(ref.out_dir)
    _, eb = read_index(base.out_dir)
    assert [m["key"] for m in ea] == [m["key"] for m in eb] and ea
    # the same step twice: every record's stored hash the same
    assert [m.get("stored_hash") or m.get("hash") for m in ea] == [m.get("stored_hash") or m.get("hash") for m in eb]

    # a rerun that fails beside the reference (its GPU busy elsewhere) runs again after it
    from tpdiag.runner import launch

    real = launch.run_world
    calls = []

    def flaky(cfg, timeout_s, on_status=None, entry=None, cancel=None, gpu_offset=0):
        calls.append((cfg.label, gpu_offset))
        if gpu_offset:
            return launch.WorldResult(cfg.label, cfg.degree, "failed", cfg.out_dir, 0.0, error="CUDA out of memory")
        return real(cfg, timeout_s, on_status, entry=entry, cancel=cancel, gpu_offset=gpu_offset)

    monkeypatch.setattr(launch, "run_world", flaky)
    a, b, offset = side_by_side.run_pair(ref, base, 120.0, None, 1)
    assert (a.status, b.status, offset) == ("ok", "ok", 0)
    assert sorted(calls) == [("1", 0), ("1-base", 0), ("1-base", 1)]


def test_breakdown_counts_a_world_run_beside_another_once():
    """The breakdown's parts stay disjoint (records/timing.read_breakdown refuses parts adding up
    past the wall time): a rerun run beside the reference adds only what it ran past its end."""
    from tpdiag.records.timing import read_breakdown
    from tpdiag.runner.timing import _first_pass

    manifest = {"reference": "1", "phases": {"setup_s": 0.1, "diff_s": 0.5}, "worlds": {
        "1": {"wall_s": 2.0, "gpu": 0}, "1-base": {"wall_s": 2.5, "gpu": 1, "beside": "1"}, "2": {"wall_s": 3.0}}}
    parts: list = []
    _first_pass(manifest, parts)
    s = {p.get("label"): p["s"] for p in parts if p["part"] == "world"}
    assert s == {"1": 2.0, "1-base": 0.5, "2": 3.0}
    assert "beside it on GPU 1" in [p for p in parts if p.get("label") == "1-base"][0]["what"]
    tb, problems = read_breakdown({"time_breakdown": {"schema": 1, "wall_s": 6.1, "parts": parts}})
    assert tb is not None and not problems
    # counted whole (the old sum), the same parts pass the wall time: the reader says so
    whole = [dict(p, s=2.5) if p.get("label") == "1-base" else p for p in parts]
    assert read_breakdown({"time_breakdown": {"schema": 1, "wall_s": 6.1, "parts": whole}})[1]


def test_an_interrupt_while_the_rerun_runs_on_cancels_it(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, raised as KeyboardInterrupt) after the reference ended, while the main thread
    waits for the rerun: the rerun is cancelled (its ranks killed), not left to a daemon thread. On
    9bf6702 the wait was outside the try: the rerun never saw the cancel."""
    import threading

    import pytest

    from tpdiag.runner import launch

    ref, base = _pair(tmp_path)
    seen = {}

    def fake(cfg, timeout_s, on_status=None, entry=None, cancel=None, gpu_offset=0):
        if cancel is None:  # the reference: done at once
            return launch.WorldResult(cfg.label, cfg.degree, "ok", cfg.out_dir, 0.0)
        seen["cancelled"] = cancel.wait(10.0)  # the rerun: runs on until cancelled
        return launch.WorldResult(cfg.label, cfg.degree, "failed", cfg.out_dir, 0.0, error="cancelled")

    class Interrupted(threading.Thread):
        joins = 0

        def join(self, timeout=None):
            Interrupted.joins += 1
            if Interrupted.joins == 1:
                raise KeyboardInterrupt  # the signal, delivered during the wait
            return super().join(timeout)

    monkeypatch.setattr(launch, "run_world", fake)
    monkeypatch.setattr(side_by_side.threading, "Thread", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        side_by_side.run_pair(ref, base, 60.0, None, 1)
    assert seen == {"cancelled": True}


def _first_pass_dir(tmp_path, per_rank=0, degree=2, peaks=(8 << 30, 4 << 30)):
    """A pass-1 run directory as pair_gpu reads it: the other world's world.json and the manifest's peaks."""
    import json

    run = RunDir(str(tmp_path / "first"))
    os.makedirs(run.world("2"), exist_ok=True)
    world = {"degree": degree, **({} if per_rank is None else {"per_rank_params": per_rank})}
    with open(os.path.join(run.world("2"), "world.json"), "w") as f:
        json.dump(world, f)
    with open(run.manifest, "w") as f:
        json.dump({"schema": 1, "worlds": {"1": {"timings": {"peak_mem_bytes": peaks[0]}},
                                           "2": {"timings": {"peak_mem_bytes": peaks[1]}}}}, f)
    return run.path


def _region_pair(tmp_path, **over):
    from dataclasses import replace

    cfg = CompareConfig.of(degrees=(1, 2), batch_size=1, seq_len=8, capture="full")
    w = cfg.worlds()
    run = RunDir(str(tmp_path / "region"))
    ref = cfg.world(w[0].point, "1", run.world("1"), "cuda", reference=True)
    other = cfg.world(w[1].point, "2", run.world("2"), "cuda", ref_dir=run.world("1"))
    return ref, (replace(other, **over) if over else other)


def test_pair_gpu_only_where_the_other_world_reads_nothing_of_the_reference(tmp_path, monkeypatch):
    """A second pass's reference beside its other world: only with whole records, one prefill step,
    no per-rank parameters (pass 1's world.json says so), GPUs of one kind that hold both peaks."""
    from dataclasses import replace

    props = type("P", (), {"name": "H", "major": 9, "minor": 0, "total_memory": 140 << 30,
                           "multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    first = _first_pass_dir(tmp_path)
    ref, other = _region_pair(tmp_path)
    assert side_by_side.pair_gpu("cuda", ref, other, first) == 1  # the last GPU, not rank 0's
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert side_by_side.pair_gpu("cuda", ref, other, first) == 2  # a GPU of its own where there is one
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert side_by_side.pair_gpu("cuda", ref, other, None) is None  # no pass 1 to learn from
    assert side_by_side.pair_gpu("cpu", ref, other, first) is None  # the host: only under force
    monkeypatch.setenv("TPDIAG_SIDE_BY_SIDE", "0")
    assert side_by_side.pair_gpu("cuda", ref, other, first) is None
    monkeypatch.delenv("TPDIAG_SIDE_BY_SIDE")
    # a hash capture places its shards by the reference's shapes; pieces and anchored steps read it too
    hashed = replace(other, settings=replace(other.settings, capture="hash"))
    assert side_by_side.pair_gpu("cuda", ref, hashed, first) is None
    assert side_by_side.pair_gpu("cuda", ref, replace(other, point=replace(other.point, micro_batch=1)), first) is None
    assert side_by_side.pair_gpu("cuda", ref, replace(other, point=replace(other.point, mode="decode")), first) is None
    two = replace(other, settings=replace(other.settings, steps=2))
    assert side_by_side.pair_gpu("cuda", ref, two, first) is None
    # per-rank parameters (gather reads the reference's parameter shapes), or a world.json from before
    assert side_by_side.pair_gpu("cuda", ref, other, _first_pass_dir(tmp_path / "ep", per_rank=4)) is None
    assert side_by_side.pair_gpu("cuda", ref, other, _first_pass_dir(tmp_path / "old", per_rank=None)) is None
    # both peaks on one GPU past its memory
    assert side_by_side.pair_gpu("cuda", ref, other, _first_pass_dir(tmp_path / "big", peaks=(90 << 30, 30 << 30))) is None
    other_kind = type("P", (), {"name": "A", "major": 8, "minor": 0, "total_memory": 140 << 30,
                                "multi_processor_count": 108})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 0 else other_kind)
    assert side_by_side.pair_gpu("cuda", ref, other, first) is None


def _verdict(s: dict) -> dict:
    """A summary less what says where and when it ran."""
    import json

    drop = ("run_dir", "timings", "second_pass_dir", "values_run_dir", "op_run_dir", "dir", "flags")

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x.replace(s["run_dir"], "RUN") if isinstance(x, str) and s.get("run_dir") else x

    return json.loads(json.dumps(clean(s)))


def test_region_worlds_at_once_give_the_verdict_and_records_one_after_the_other_gives(tmp_path):
    """The second pass's two worlds run at once (TPDIAG_SIDE_BY_SIDE=force: on the host) and one after
    the other (=0) on a planted bug behind the first divergence: the same summary - the bug still
    named - and the same region records, bit for bit; the manifest says which ran beside which."""
    import json

    from conftest import run_cli

    from tpdiag.records.rundir import read_manifest
    from tpdiag.records.store import read_index

    out = {}
    for knob in ("force", "0"):
        d = tmp_path / knob
        p = run_cli("compare", "--model", "py:tests/models/planted/behind.py:bugs", "--tp", "1,2",
                    "--capture", "hash", "--no-baseline", "--format", "json", "--out", str(d),
                    env={"OMP_NUM_THREADS": "1", "TPDIAG_SIDE_BY_SIDE": knob})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[knob] = json.loads(p.stdout)
    assert out["force"]["class"] == "bug"
    assert _verdict(out["force"]) == _verdict(out["0"])
    worlds = {k: read_manifest(str(tmp_path / k / "region"))["worlds"] for k in out}
    assert worlds["force"]["1"]["beside"] == "2" and "beside" not in worlds["0"]["1"], worlds
    for label in ("1", "2"):
        a = read_index(RunDir(str(tmp_path / "force" / "region")).world(label))[1]
        b = read_index(RunDir(str(tmp_path / "0" / "region")).world(label))[1]
        assert [m["key"] for m in a] == [m["key"] for m in b] and a
        assert [m.get("stored_hash") or m.get("hash") for m in a] == [m.get("stored_hash") or m.get("hash") for m in b]
    tb = read_manifest(str(tmp_path / "force"))["time_breakdown"]
    second = [p for p in tb["parts"] if p["part"] == "second-pass"][0]
    assert "TP=1 beside TP=2" in second["what"], second


def test_run_beside_runs_a_world_that_failed_beside_again_alone(tmp_path, monkeypatch):
    """Out of memory beside the other world (its GPU shared): that world runs again alone after both,
    the reference where it ran before (GPU 0), and the result says it did not run beside."""
    from tpdiag.runner import launch

    ref, other = _region_pair(tmp_path)
    calls = []

    def fake(cfg, timeout_s, on_status=None, entry=None, cancel=None, gpu_offset=0):
        calls.append((cfg.label, gpu_offset))
        failed = cfg.label == "1" and gpu_offset == 1
        return launch.WorldResult(cfg.label, cfg.degree, "failed" if failed else "ok", cfg.out_dir, 0.0,
                                  error="CUDA out of memory" if failed else None)

    monkeypatch.setattr(launch, "run_world", fake)
    a, b, gpu = side_by_side.run_beside(ref, other, 60.0, None, 1)
    assert (a.status, b.status, gpu) == ("ok", "ok", None)
    assert sorted(calls) == [("1", 0), ("1", 1), ("2", 0)]
    calls.clear()
    a, b, gpu = side_by_side.run_beside(ref, other, 60.0, None, 2)  # its own GPU: nothing failed
    assert (a.status, b.status, gpu) == ("ok", "ok", 2) and sorted(calls) == [("1", 2), ("2", 0)]
