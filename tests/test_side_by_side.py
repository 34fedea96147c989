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
