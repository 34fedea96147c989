"""One writer per capture directory (red team hred11): a second `tpdiag.capture` into a DIR while a first
one is still inside its block - the same script started twice, two jobs given one out= - is refused in one
line, as a second compare into a held --out is. On the code before it entered, unlinked the first one's
manifest and wrote its own files over the first one's, file by file: the last world.json written could
name the other capture's records. The lock goes when the block ends, with or without an exception."""
import json
import os

import pytest
import torch

import tpdiag
from tpdiag.errors import BadInput


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _step(cap, m, x):
    cap.batch(input_ids=x)
    m(x).sum().backward()


def test_a_second_capture_into_a_held_dir_is_refused(tmp_path):
    out = str(tmp_path / "cap")
    m, x = _model(), torch.randn(2, 4)
    with tpdiag.capture(m, out=out) as first:
        with pytest.raises(BadInput, match="is in use by another tpdiag run"):
            with tpdiag.capture(_model(), out=out):
                pass
        _step(first, m, x)
    assert sorted(os.listdir(out)) == ["events.jsonl", "manifest.json", "records.safetensors", "world.json"]
    first_id = json.loads((tmp_path / "cap" / "world.json").read_text())["capture_id"]
    with tpdiag.capture(m, out=out) as again:  # free again once the first block ended
        _step(again, m, x)
    assert json.loads((tmp_path / "cap" / "world.json").read_text())["capture_id"] != first_id


def test_the_lock_goes_with_a_block_that_raised(tmp_path):
    out = str(tmp_path / "cap")
    m, x = _model(), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="user step failed"):
        with tpdiag.capture(m, out=out):
            raise RuntimeError("user step failed")
    with tpdiag.capture(m, out=out) as cap:
        _step(cap, m, x)
    assert os.path.isfile(os.path.join(out, "manifest.json")) and not os.path.exists(os.path.join(out, ".tpdiag.lock"))
