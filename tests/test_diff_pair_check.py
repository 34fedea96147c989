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


def test_equal_pair_needs_one_hash_pass_and_gives_the_same_rows(tp12_run, monkeypatch):
    from tpdiag.diff import engine

    calls = _count_hashes(monkeypatch)
    rows = engine.diff_degree(*_sets(tp12_run), "1-base").rows
    assert rows and all(r["bitwise"] for r in rows)  # the reference rerun: bitwise
    assert len(calls) == len(rows)  # one hash a pair, the reference's: it answers for both sides
    # every record checked (the pair check off): the same rows, one hash per stored tensor
    calls.clear()
    monkeypatch.setattr(engine, "_read_pair", lambda ref, rm, other, om: (ref.tensor(rm), other.tensor(om)))
    assert engine.diff_degree(*_sets(tp12_run), "1-base").rows == rows
    assert len(calls) == 2 * len(rows)


def test_an_edited_record_is_still_refused(tp12_run, tmp_path, monkeypatch):
    from tpdiag.diff import bits, engine, pair_memo

    meta = _edit(tp12_run / "tp1-base", tmp_path / "tp1-base")
    shutil.copytree(tp12_run / "tp1", tmp_path / "tp1")
    with pytest.raises(Inconclusive, match="does not match its hash"):
        engine.diff_degree(*_sets(tmp_path), "1-base")
    # negative control: a pair check that trusted the index hashes alone would pass the edited
    # record on to the comparison, which reads the edit as a divergence of the run
    monkeypatch.setattr(bits, "bitwise_equal", lambda a, b: True)
    pair_memo.clear()  # the unedited pair's measures (the test above) are not this pair's
    rows = engine.diff_degree(*_sets(tmp_path), "1-base").rows
    assert [r["key"] for r in rows if not r["bitwise"]] == [meta["key"]]


def _stacked_rows_equal(run) -> list:
    """TP=2's records stored as a stack of row shards whose bytes, in order, are the reference's
    whole tensor (a column-parallel weight at init): [(key, numel)]."""
    from tpdiag.diff import bits

    ref, other = _sets(run, "tp2")
    out = []
    for om in other.events:
        rm = ref.by_key.get(om["key"])
        if om.get("stored") != "stacked" or rm is None or rm.get("stored") != "single":
            continue
        rt, ot = ref.tensor(rm), other.tensor(om)
        if rt.dtype == ot.dtype and rt.numel() == ot.numel() and rt.shape != ot.shape \
                and torch.equal(bits.raw_bits(rt).reshape(-1), bits.raw_bits(ot).reshape(-1)):
            out.append((om["key"], rt.numel()))
    return out


def test_row_shards_equal_to_the_whole_need_one_hash_pass(tp12_run, monkeypatch):
    """A stack of row shards and the reference's whole tensor hold the same bytes in the same
    order: their hashes hold the same lanes (records/hashing.lanes_of), so one bytes comparison
    checks both, as for two equal whole tensors - and the rows are those of hashing both."""
    from tpdiag.diff import engine, pair_memo

    stacked = _stacked_rows_equal(tp12_run)
    assert stacked  # the TP=2 world has them (its column-parallel weights)
    pair_memo.clear()
    calls = _count_hashes(monkeypatch)
    rows = engine.diff_degree(*_sets(tp12_run, "tp2"), "2").rows
    spared = list(calls)
    pair_memo.clear()
    calls.clear()
    monkeypatch.setattr(engine, "_read_pair", lambda ref, rm, other, om: (ref.tensor(rm), other.tensor(om)))
    assert engine.diff_degree(*_sets(tp12_run, "tp2"), "2").rows == rows
    assert len(calls) - len(spared) >= len(stacked)  # one side of each such pair spared


def _numel(r) -> int:
    n = 1
    for d in r["shape"]:
        n *= d
    return n


def test_an_edited_row_shard_is_still_refused(tp12_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tpdiag.diff import engine, pair_memo, pair_read
    from tpdiag.records.store import RecordSet

    key = _stacked_rows_equal(tp12_run)[0][0]
    shutil.copytree(tp12_run / "tp1", tmp_path / "tp1")
    shutil.copytree(tp12_run / "tp2", tmp_path / "tp2")
    meta = RecordSet(str(tmp_path / "tp2")).by_key[key]
    tensors = load_file(str(tmp_path / "tp2" / "records.safetensors"))
    t = tensors[str(meta["idx"])].clone()
    t.view(-1)[-1] = torch.nextafter(t.view(-1)[-1], torch.tensor(1.0, dtype=t.dtype))
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(tmp_path / "tp2" / "records.safetensors"), metadata={"schema": "1"})
    pair_memo.clear()
    with pytest.raises(Inconclusive, match=f"record {key} does not match its hash"):
        engine.diff_degree(*_sets(tmp_path, "tp2"), "2")
    # negative control: checked by the index hashes' lanes alone (no bytes comparison), the edit
    # would pass as the stored record and read as a divergence of the run
    monkeypatch.setattr(pair_read, "same_stored_bytes", lambda *a: True)
    pair_memo.clear()
    rows = engine.diff_degree(*_sets(tmp_path, "tp2"), "2").rows
    assert next(r for r in rows if r["key"] == key)["bitwise"] is False


def test_an_index_hash_that_is_no_hash_is_refused_in_one_line(tp12_run, tmp_path):
    # a row-shard stack [2, n/2, ...] against the reference's whole tensor is checked by one bytes
    # comparison where both index hashes hold the same lanes; an index hash edited to something that
    # is no hex number raised ValueError out of that comparison (a traceback) - now each side's own
    # check refuses it
    import json

    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    for w in ("tp1", "tp2"):
        shutil.copytree(tp12_run / w, tmp_path / w)
    path = tmp_path / "tp2" / "events.jsonl"
    lines = path.read_text().splitlines()
    stacked = next(i for i, ln in enumerate(lines) if json.loads(ln).get("stored") == "stacked")
    m = json.loads(lines[stacked])
    m["stored_hash"] = "not-a-hash"
    lines[stacked] = json.dumps(m)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(Inconclusive):
        analyse_degree(RecordSet(str(tmp_path / "tp1")), RecordSet(str(tmp_path / "tp2")), "2")


def test_the_same_edit_of_both_sides_is_refused(tp12_run, tmp_path):
    # two files edited alike stay bitwise equal: the pair check vouched for both without a hash
    # pass, and the edited values went on into the diff (a record both sides hold, then the bounds
    # read from it). The reference's own check now fails them
    from tpdiag.diff import engine

    _edit(tp12_run / "tp1", tmp_path / "tp1")
    _edit(tp12_run / "tp1-base", tmp_path / "tp1-base")
    with pytest.raises(Inconclusive, match="does not match its hash"):
        engine.diff_degree(*_sets(tmp_path), "1-base")
