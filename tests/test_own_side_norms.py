"""The own-input pass's reference keeps its float64 weight grads re-executed from TP=2's inputs as
the figures the diff reads of them (probes/own_side_norms.py: ||o_2||, ||y_2 - o_2||, o_2 finite,
numel and the hash of the TP=2 record y_2 they were taken against), under `param_grad.W~norms@2`,
not o_2 whole (1.87 of the 2.04 GB that world wrote at llama-1b). The verdicts are those of the
whole values (TPDIAG_OWN_SIDE_NORMS=0, the control); the figures are records like any other (an
edit is refused by their stored hash); figures taken against another value than the record the
diff reads judge nothing (refused, never a verdict).

And each stored tensor is hash-checked once per compare (records/checked.py): the own-input
diff's sets over the region pass's files do not hash again what the region diff checked; a file
replaced in between is checked afresh."""
import shutil

import pytest
import torch

from tpdiag.errors import Inconclusive


def test_judge_own_side_is_judge_own_from_the_values():
    from tpdiag.diff.oracle import judge_own
    from tpdiag.diff.own_side import REFUSED, judge_own_side
    from tpdiag.probes.oracle_hooks import ref_norms
    from tpdiag.probes.own_side_norms import side_record
    from tpdiag.records.hashing import HASH_VERSION

    g = torch.Generator().manual_seed(0)
    o_ref = torch.randn(64, 48, generator=g, dtype=torch.float64)
    o_n = o_ref + 1e-3 * torch.randn(64, 48, generator=g, dtype=torch.float64)
    y_ref = (o_ref + 1e-3 * torch.randn(64, 48, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    y_n = (o_n + 2e-2 * torch.randn(64, 48, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    for ref, norms in ((o_ref, None), (None, ref_norms(y_ref, o_ref)), (None, None)):
        whole = judge_own(y_ref, y_n, ref, o_n, ref_norms=norms)
        assert judge_own_side(y_ref, y_n, ref, side_record(y_n, o_n), HASH_VERSION, ref_norms=norms) == whole
    # o_n zero (the s_n == 0 branch) and not finite (no verdict), as from the whole value
    z = torch.zeros_like(o_n)
    assert judge_own_side(y_ref, y_n, o_ref, side_record(y_n, z), HASH_VERSION) == judge_own(y_ref, y_n, o_ref, z)
    inf = o_n.clone()
    inf[0, 0] = float("inf")
    assert judge_own_side(y_ref, y_n, o_ref, side_record(y_n, inf), HASH_VERSION) is None is judge_own(y_ref, y_n, o_ref, inf)
    # figures of another y: refused, where the whole value would have given a verdict for this one
    other = y_n.clone()
    other[0, 0] += 1
    assert judge_own_side(y_ref, y_n, o_ref, side_record(other, o_n), HASH_VERSION) is REFUSED
    assert judge_own(y_ref, y_n, o_ref, o_n) is not None


def _hashes(monkeypatch) -> list:
    from tpdiag.records import hashing

    calls, real = [], hashing.tensor_hash
    monkeypatch.setattr(hashing, "tensor_hash", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _read_all(folder):
    from tpdiag.records.store import RecordSet

    rs = RecordSet(str(folder))
    for m in rs.events:
        if m.get("stored") != "hash":
            rs.tensor(m)


def test_a_tensor_is_hash_checked_once_per_compare(tp12_run, tmp_path, monkeypatch):
    import os

    from tpdiag.records import checked

    # a hard link, as the own-input pass links the region pass's worlds (runner/compare._linked)
    (tmp_path / "a").mkdir()
    for f in os.listdir(tp12_run / "tp2"):
        os.link(tp12_run / "tp2" / f, tmp_path / "a" / f)
    calls = _hashes(monkeypatch)
    with checked.session():
        _read_all(tp12_run / "tp2")
        first = len(calls)
        assert first > 0
        _read_all(tmp_path / "a")  # another set over the same files: nothing hashed again
        assert len(calls) == first
        # a copy (another inode) is checked afresh, and an edit of it refused
        shutil.copytree(tp12_run / "tp2", tmp_path / "b")
        _read_all(tmp_path / "b")
        assert len(calls) == 2 * first
        _edit_one(tmp_path / "b")
        with pytest.raises(Inconclusive, match="does not match its hash"):
            _read_all(tmp_path / "b")
    # negative controls: outside a compare, or with TPDIAG_CHECK_ONCE=0, every set hashes again
    n = len(calls)
    _read_all(tmp_path / "a")
    assert len(calls) > n
    monkeypatch.setenv("TPDIAG_CHECK_ONCE", "0")
    with checked.session():
        _read_all(tp12_run / "tp2")
        n = len(calls)
        _read_all(tmp_path / "a")
        assert len(calls) == n + first


def test_a_world_linked_after_its_check_stays_checked(tp12_run, tmp_path, monkeypatch):
    """The own-input pass links the region pass's worlds after the region diff checked them; link(2)
    moves the files' change time, so every check made before it was lost and the own-input diff
    hashed every TP>1 record again. runner/compare._linked carries them (records/checked.linked);
    a file edited in place between the check and the link (its mtime put back) is hashed again."""
    import os

    from tpdiag.records import checked
    from tpdiag.runner.compare import _linked

    src = tmp_path / "region" / "tp2"
    shutil.copytree(tp12_run / "tp2", src)
    calls = _hashes(monkeypatch)
    with checked.session():
        _read_all(src)
        first = len(calls)
        assert first > 0
        _linked(str(src), str(tmp_path / "ops" / "tp2"), "2", 2, "same")
        assert os.path.samefile(src / "records.safetensors", tmp_path / "ops" / "tp2" / "records.safetensors")
        _read_all(tmp_path / "ops" / "tp2")
        assert len(calls) == first
        # negative control: a plain link after the check (what _linked did before) hashes it all again
        (tmp_path / "plain").mkdir()
        for f in os.listdir(src):
            os.link(src / f, tmp_path / "plain" / f)
        _read_all(tmp_path / "plain")
        assert len(calls) == 2 * first
        # an edit in place with its modification time put back, then linked: checked afresh, refused
        st = os.stat(src / "records.safetensors")
        _edit_one(src)
        os.utime(src / "records.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
        _linked(str(src), str(tmp_path / "edited" / "tp2"), "2", 2, "same")
        with pytest.raises(Inconclusive, match="does not match its hash"):
            _read_all(tmp_path / "edited" / "tp2")


def _edit_one(folder):
    from safetensors.torch import load_file, save_file

    from tpdiag.records.store import RecordSet

    meta = next(m for m in RecordSet(str(folder)).events if m.get("stored") != "hash" and m["dtype"] == "float32")
    tensors = load_file(str(folder / "records.safetensors"))
    t = tensors[str(meta["idx"])].clone()
    t.view(-1)[0] += 1.0
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(folder / "records.safetensors"), metadata={"schema": "1"})
