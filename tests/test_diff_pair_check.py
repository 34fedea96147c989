"""The diff's read of a record pair (diff/engine._read_pair): each stored tensor is checked
against its stored hash - a whole pass per tensor, most of a second pass's diff on the host -
except where both index hashes agree and the two tensors are bitwise equal: no pass then, and the
same rows. An edit of one side's file still makes that side's check run and refuse it; the
negative control shows that the bits comparison, not the index alone, is what catches it."""
import shutil

import pytest
import torch

from tpdiag.errors import Inconclusive


def _sets(run, other="tp1-base"):
    from tpdiag.records.store import RecordSet

    return RecordSet(str(run / "tp1")), RecordSet(str(run / other))


def _count_hashes(monkeypatch) -> list:
    from tpdiag.records import hashing

    calls, real = [], hashing.tensor_hash
    monkeypatch.setattr(hashing, "tensor_hash", lambda t, *a: calls.append(t.numel()) or real(t, *a))
    return calls


def _edit(src, dst):
    """A copy of a world whose one float record is one ULP off, its index untouched."""
    from safetensors.torch import load_file, save_file

    from tpdiag.records.store import RecordSet

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "records.safetensors"))
    meta = next(m for m in RecordSet(str(dst)).events if m["kind"] == "out" and m["dtype"] == "float32")
    t = tensors[str(meta["idx"])].clone()
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(1.0))
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(dst / "records.safetensors"), metadata={"schema": "1"})
    return meta


def test_equal_pair_needs_no_hash_pass_and_gives_the_same_rows(tp12_run, monkeypatch):
    from tpdiag.diff import engine

    calls = _count_hashes(monkeypatch)
    rows = engine.diff_degree(*_sets(tp12_run), "1-base").rows
    assert rows and all(r["bitwise"] for r in rows)  # the reference rerun: bitwise
    assert calls == []  # no stored tensor hashed: every pair vouched for itself
    # every record checked (the pair check off): the same rows, one hash per stored tensor
    monkeypatch.setattr(engine, "_read_pair", lambda ref, rm, other, om: (ref.tensor(rm), other.tensor(om)))
    assert engine.diff_degree(*_sets(tp12_run), "1-base").rows == rows
    assert len(calls) == 2 * len(rows)


def test_an_edited_record_is_still_refused(tp12_run, tmp_path, monkeypatch):
    from tpdiag.diff import bits, engine

    meta = _edit(tp12_run / "tp1-base", tmp_path / "tp1-base")
    shutil.copytree(tp12_run / "tp1", tmp_path / "tp1")
    with pytest.raises(Inconclusive, match="does not match its hash"):
        engine.diff_degree(*_sets(tmp_path), "1-base")
    # negative control: a pair check that trusted the index hashes alone would pass the edited
    # record on to the comparison, which reads the edit as a divergence of the run
    monkeypatch.setattr(bits, "bitwise_equal", lambda a, b: True)
    rows = engine.diff_degree(*_sets(tmp_path), "1-base").rows
    assert [r["key"] for r in rows if not r["bitwise"]] == [meta["key"]]
