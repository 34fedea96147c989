"""The reference world's stored tensors are hash-checked in a thread while the pass's other worlds
run (runner/precheck.py): the diff then finds them checked (records/checked.py) and hashes none of
them again. Nothing is judged there: an edited tensor is not counted as checked, and the diff's read
refuses it as before; outside a compare's session, or with TPDIAG_PRECHECK=0, nothing starts."""
import shutil

import pytest

from tpdiag.errors import Inconclusive
from test_own_side_norms import _edit_one, _hashes, _read_all


def test_the_reference_checked_while_others_run_is_not_hashed_again(tp12_run, tmp_path, monkeypatch):
    from tpdiag.records import checked
    from tpdiag.runner import precheck

    calls = _hashes(monkeypatch)
    with checked.session():
        p = precheck.start(str(tp12_run / "tp1"))
        assert p is not None
        p.done()
        first = len(calls)
        assert first > 0 and p.checked == first
        _read_all(tp12_run / "tp1")  # the diff's read: nothing hashed again
        assert len(calls) == first
    # negative control: without the precheck the same read hashes every tensor
    with checked.session():
        _read_all(tp12_run / "tp1")
        assert len(calls) == 2 * first
    # off, or outside a compare: nothing starts
    assert precheck.start(str(tp12_run / "tp1")) is None
    monkeypatch.setenv("TPDIAG_PRECHECK", "0")
    with checked.session():
        assert precheck.start(str(tp12_run / "tp1")) is None


def test_an_edited_tensor_is_left_to_the_diff_which_refuses_it(tp12_run, tmp_path):
    from tpdiag.records import checked
    from tpdiag.runner import precheck

    shutil.copytree(tp12_run / "tp1", tmp_path / "tp1")
    _edit_one(tmp_path / "tp1")
    with checked.session():
        p = precheck.start(str(tmp_path / "tp1"))
        p.done()
        with pytest.raises(Inconclusive, match="does not match its hash"):
            _read_all(tmp_path / "tp1")
