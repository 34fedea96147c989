"""The diff's float64 work (the Linear bound's GEMMs, the float64 verdicts' norms) runs on the
device the compare's parent checks record hashes on (records/hashing.checks_on, diff/on_device.py).
On this CPU: with a check device (here the host itself, every tensor moved "there") the decision
path and every figure are those without one - the same rows, the same entry; the negative control
shows the comparison sees a device that computed otherwise. On a GPU host the verdicts (cause,
beyond the bound, float64 far) are the host's."""
import json

import pytest
import torch


def _second_pass(run):
    s = json.loads((run / "summary.json").read_text())
    return s["second_pass"]["dir"]


def _analyse(d, device=None):
    from tpdiag.diff import pair_memo
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.hashing import checks_on
    from tpdiag.records.store import RecordSet

    pair_memo.clear()
    with checks_on(device):
        return analyse_degree(RecordSet(f"{d}/tp1"), RecordSet(f"{d}/tp2"), "2")


def _moves(monkeypatch) -> list:
    from tpdiag.diff import on_device

    moved = []
    real = on_device.run
    monkeypatch.setattr(on_device, "_MIN", 0)
    monkeypatch.setattr(on_device, "run", lambda fn, *ts: moved.append(fn.__name__) or real(fn, *ts))
    return moved


def test_a_check_device_changes_no_decision(behind_bugs_run, monkeypatch):
    d = _second_pass(behind_bugs_run)
    host, host_rows = _analyse(d)
    moved = _moves(monkeypatch)
    dev, dev_rows = _analyse(d, "cpu")
    # the bounds, both verdicts and the measures of the pairs that differ went there
    assert {"work", "_judge", "_judge_own", "measure_pair"} <= set(moved), moved
    assert dev_rows == host_rows and dev == host
    assert any((r.get("oracle") or {}).get("own") and r.get("beyond_bound") for r in host_rows)  # a bug judged
    assert any(r.get("bound") is not None for r in host_rows)  # Linear bounds measured
    # negative control: a device whose bound came out otherwise is seen
    from tpdiag.diff import bounds

    real = bounds.linear_bound
    monkeypatch.setattr(bounds, "linear_bound", lambda *a: real(*a) * (1.5 if a[0].device.type == "cpu" else 1))
    assert _analyse(d, "cpu")[1] != host_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_verdicts_are_the_hosts(behind_bugs_run):
    d = _second_pass(behind_bugs_run)
    host, host_rows = _analyse(d)
    dev, dev_rows = _analyse(d, "cuda:0")

    def verdicts(rows):
        return [(r["key"], r.get("beyond_bound"), (r.get("oracle") or {}).get("far")) for r in rows]

    assert verdicts(dev_rows) == verdicts(host_rows)
    assert dev["first_divergence"]["cause"] == host["first_divergence"]["cause"]
    assert [(f["key"], f["cause"]) for f in dev["findings"]] == [(f["key"], f["cause"]) for f in host["findings"]]
