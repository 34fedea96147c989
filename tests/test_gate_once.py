"""`tpdiag gate` measures each record pair once and hash-checks each stored tensor once per evaluation
(tpdiag/gate/once.py): its first-pass re-diff, the second pass's re-diffs and the reference rerun's read
the same pairs, which were measured and hashed again at every read (a llama-1b bf16 gate took longer
than its compare). What it outputs must not move: the gate's result (to_dict, its lines, its JUnit, its
exit code) and every re-diff's rows come out the same with TPDIAG_GATE_ONCE=0 (the old path) and without,
on planted runs, a bug run and edited copies - whose problems must still be found (a pair is looked up
only after both its tensors were checked against their stored hashes)."""
import json
import re
import shutil
import struct

import pytest

from tpdiag.gate import evaluate, load_policy, with_allowed
from tpdiag.gate.junit import junit_xml


def _flip_a_value(path):
    """One bit of the largest stored tensor flipped, the file's header and index untouched."""
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    start, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"),
                     key=lambda o: o[1] - o[0])
    b[8 + n + (start + end) // 2 // 4 * 4] ^= 1
    path.write_bytes(bytes(b))


def _rows_of_every_diff(monkeypatch) -> list:
    """The rows of every re-diff the gate makes, in order (diff_degree as recheck and analyse call it)."""
    from tpdiag.diff import analyse, engine

    out, real = [], engine.diff_degree

    def spy(*a, **k):
        dd = real(*a, **k)
        out.append((dd.label, json.dumps(dd.rows, sort_keys=True, default=repr), sorted(dd.tensors)))
        return dd
    monkeypatch.setattr(engine, "diff_degree", spy)
    monkeypatch.setattr(analyse, "diff_degree", spy)
    return out


POLICIES = {"default": lambda: load_policy(None), "rounding": lambda: with_allowed(load_policy(None), "rounding")}


def _gate(run, monkeypatch, once: bool, policies=tuple(POLICIES)):
    monkeypatch.setenv("TPDIAG_GATE_ONCE", "1" if once else "0")
    rows = _rows_of_every_diff(monkeypatch)
    from tpdiag.diff import bits

    compares, real = [], bits.compare
    monkeypatch.setattr(bits, "compare", lambda *a, **k: compares.append(1) or real(*a, **k))
    got = {}
    for name in policies:
        res = evaluate(str(run), POLICIES[name]())
        got[name] = (res.exit_code, json.dumps(res.to_dict(), sort_keys=True, default=str), res.lines(),
                     re.sub(rb' timestamp="[^"]*"', b"", junit_xml(res)))  # the hour it was written
    monkeypatch.undo()
    return got, rows, len(compares)


def _same_both_ways(run, monkeypatch, policies=tuple(POLICIES)):
    old, old_rows, old_n = _gate(run, monkeypatch, False, policies)
    new, new_rows, new_n = _gate(run, monkeypatch, True, policies)
    assert new == old
    assert new_rows == old_rows and old_rows  # every re-diff, row for row
    return old, old_n, new_n


def test_the_same_gate_both_ways_on_a_run_with_a_second_pass(tp12_run, monkeypatch):
    got, old_n, new_n = _same_both_ways(tp12_run, monkeypatch)
    assert got["default"][0] == 1 and got["rounding"][0] == 0  # rounding only: the run compare made
    assert new_n < old_n  # pairs read again are measured once


def test_the_same_gate_both_ways_on_a_bug(behind_bugs_run, monkeypatch):
    got, old_n, new_n = _same_both_ways(behind_bugs_run, monkeypatch)
    assert got["rounding"][0] == 4  # the planted bugs fail even --allow rounding
    assert new_n < old_n


@pytest.mark.parametrize("where", [("tp2",), ("ops", "tp2"), ("tp1",)])
def test_an_edited_record_is_found_both_ways(tp12_run, tmp_path, monkeypatch, where):
    # the memo is looked up by the index's stored hashes, which an edit of the tensor bytes leaves as
    # they were: only the check of both tensors before the lookup tells the edited pair from the one
    # measured before it
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run, symlinks=True)
    _flip_a_value(run.joinpath(*where, "records.safetensors"))
    got, _, _ = _same_both_ways(run, monkeypatch, ("rounding",))  # an evidence problem: no policy passes it
    code, result, _, _ = got["rounding"]
    assert code == 2, (where, result)
    assert "does not match its hash" in result
