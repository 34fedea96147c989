"""Fail closed, red team hred10: a record no comparison reads is still checked.

The gate re-reads every record it re-diffs, each against its stored hash - but only those: a decode
configuration runs forward only, so its prefill reference's backward records (grads, the optimizer's
parameters) are compared with nothing and were never read. A value edited inside the reference's
records.safetensors there, its header intact, passed `gate --allow rounding` (exit 0) and the report.
Now every stored record of a re-diffed world that no comparison read is checked against its hash too.

One real compare (tiny-llama at TP=1, prefill against decode, backward at the reference) per module;
each case edits a copy.
"""
import json
import shutil
import struct

import pytest
from conftest import run_cli

from tpdiag.gate import evaluate, load_policy, with_allowed


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("unread") / "run"
    p = run_cli("compare", "--tp", "1", "--mode", "prefill,decode", "--batch-size", "2", "--seq-len", "8",
                "--no-confirm", "--no-baseline", "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture()
def run(decode_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(decode_run, dst, symlinks=True)
    return dst


def _flip(path, idx):
    """One bit of record idx's first stored value flipped, the file's header untouched."""
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    start, end = json.loads(b[8:8 + n])[str(idx)]["data_offsets"]
    assert end > start
    b[8 + n + start] ^= 1
    path.write_bytes(bytes(b))


def _unread(run):
    """A stored record of the reference that the decode configuration has no record for."""
    ev = [json.loads(x) for x in (run / "tp1" / "events.jsonl").read_text().splitlines()]
    other = {json.loads(x)["key"] for x in (run / "tp1-decode" / "events.jsonl").read_text().splitlines()}
    m = next(m for m in ev if m["phase"] == "backward" and m["key"] not in other and m.get("stored") != "hash")
    return m


def test_the_untouched_run_passes(decode_run):
    res = evaluate(str(decode_run), _rounding())
    assert res.exit_code == 0, res.lines()  # the control


def test_a_value_edited_in_a_record_nothing_compares_is_inconclusive(run, tmp_path):
    m = _unread(run)
    _flip(run / "tp1" / "records.safetensors", m["idx"])
    res = evaluate(str(run), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()
    assert any(m["key"] in p and "does not match its hash" in p for p in res.problems), res.problems
    r = run_cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 2 and "does not match its hash" in r.stderr + r.stdout, r.stderr + r.stdout
