"""A record pair measured twice in one process (the own-input pass's diff of the region pass's
records, runner/drill.py) is measured once (diff/pair_memo.py): its bit comparison, NaN/Inf and
bounds come back for the same checked content, with the same rows. The key is looked up only
after both tensors were checked against their stored hashes: an edited file is refused, not
answered from the memo (negative control: without that check, the memo would hide the edit)."""
import shutil

import pytest
import torch

from tpdiag.errors import Inconclusive


def _diff(run):
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    entry, rows = analyse_degree(RecordSet(str(run / "tp1")), RecordSet(str(run / "tp2")), "2")
    return entry, rows


def _count(monkeypatch, mod, name) -> list:
    calls, real = [], getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_the_second_diff_of_the_same_records_measures_nothing_again(tp12_run, monkeypatch):
    from tpdiag.diff import bits, bounds, own_inputs, pair_memo

    compares = _count(monkeypatch, bits, "compare")
    linear = _count(monkeypatch, bounds, "linear_bound")  # before the first diff: one key for both
    growth = _count(monkeypatch, own_inputs, "_growth_of")  # the own-input modules' pick
    with pair_memo.session():  # one compare's (runner/session.py)
        entry, rows = _diff(tp12_run)
        assert compares and linear and growth and any(not r["bitwise"] for r in rows)
        first = (len(compares), len(linear), len(growth))
        again, rows_again = _diff(tp12_run)
        assert (len(compares), len(linear), len(growth)) == first  # nothing measured the second time
        assert rows_again == rows and again == entry
    # the session over, nothing is kept: measured afresh, the same
    assert _diff(tp12_run) == (entry, rows)
    assert len(compares) == 2 * first[0]


def test_nothing_is_kept_outside_a_compare(tp12_run, monkeypatch):
    # a measure patched in one place (a test's negative control, a notebook's experiment) must not
    # answer for the same content later in the process: outside a session the memo keeps nothing.
    # It did: test_diff_pair_check's `bitwise_equal = True` made a later compare's diff.csv call a
    # differing pair bitwise (the gate: "records or diff.csv edited after the run")
    from tpdiag.diff import bits

    _, rows = _diff(tp12_run)
    monkeypatch.setattr(bits, "bitwise_equal", lambda a, b: True)
    monkeypatch.setattr(bits, "compare", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    import pytest as _pytest

    with _pytest.raises(AssertionError, match="measured"):
        _diff(tp12_run)  # measured again (the patched compare runs), not answered from a memo


def test_an_edited_record_is_refused_not_answered_from_the_memo(tp12_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tpdiag.diff import engine, pair_memo
    from tpdiag.records.store import RecordSet

    with pair_memo.session():  # one compare's (runner/session.py)
        _, rows = _diff(tp12_run)
        key = next(r["key"] for r in rows if not r["bitwise"] and r["dtype"] == "float32")
        for w in ("tp1", "tp2"):
            shutil.copytree(tp12_run / w, tmp_path / w)
        meta = RecordSet(str(tmp_path / "tp2")).by_key[key]
        tensors = load_file(str(tmp_path / "tp2" / "records.safetensors"))
        t = tensors[str(meta["idx"])].clone()
        t.view(-1)[0] += 1.0
        tensors[str(meta["idx"])] = t
        save_file(tensors, str(tmp_path / "tp2" / "records.safetensors"), metadata={"schema": "1"})
        with pytest.raises(Inconclusive, match=f"record {key} does not match its hash"):
            _diff(tmp_path)
        # negative control: read without the hash check, the edited pair's content key (its index)
        # finds the unedited measures - the check is what keeps the memo to the bytes it names
        monkeypatch.setattr(engine, "_read_pair", lambda ref, rm, other, om: (ref.tensor(rm, verify=False),
                                                                             other.tensor(om, verify=False)))
        _, edited = _diff(tmp_path)
        assert next(r for r in edited if r["key"] == key)["max_abs"] == next(r for r in rows if r["key"] == key)["max_abs"]
