"""Order-aware record hashes: stable across processes, sensitive to one bit and to order, and
an edited record file is caught on read (not compared as if it were the evidence)."""
import shutil
import subprocess
import sys

import pytest
import torch

from tpdiag.errors import Inconclusive
from tpdiag.records.hashing import tensor_hash


def test_hash_is_the_same_in_another_process():
    code = "import torch; from tpdiag.records.hashing import tensor_hash as h; print(h(torch.arange(12.).reshape(3, 4)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == tensor_hash(torch.arange(12.).reshape(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_hash_sees_one_ulp_order_and_sign_of_zero(dtype):
    a = torch.arange(1, 65).to(dtype).reshape(8, 8)
    b = a.clone()
    b.view(-1)[17] += 1
    assert tensor_hash(a) == tensor_hash(a.clone())
    assert tensor_hash(a) != tensor_hash(b)
    assert tensor_hash(a) != tensor_hash(a.t().contiguous())
    assert tensor_hash(a) != tensor_hash(a.reshape(4, 16))
    if dtype.is_floating_point:
        assert tensor_hash(torch.zeros(3, dtype=dtype)) != tensor_hash(-torch.zeros(3, dtype=dtype))


def test_edited_record_is_refused(stock_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from tpdiag.records.store import RecordSet

    d = tmp_path / "tp2"
    shutil.copytree(stock_run / "tp2", d)
    tensors = load_file(str(d / "records.safetensors"))
    rs = RecordSet(str(d))
    meta = next(m for m in rs.events if m["kind"] == "out" and m["dtype"] == "float32")
    t = tensors[str(meta["idx"])].clone()
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(1.0))  # one ULP, same dtype/shape
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(d / "records.safetensors"), metadata={"schema": "1"})
    rs = RecordSet(str(d))
    with pytest.raises(Inconclusive, match="does not match its hash"):
        rs.tensor(meta)


def test_hash_launch_knob_is_checked(monkeypatch):
    """TPDIAG_HASH_WAVES16 (the 16-bit launch's programs per SM, an A/B knob): a bad value is one
    clear error (BadInput: the CLI's one line), a good one is used, 32-bit data keeps WAVES."""
    from tpdiag.errors import BadInput
    from tpdiag.kernels import record_hash as rh

    for bad in ("abc", "0", "65", "-1"):
        monkeypatch.setenv("TPDIAG_HASH_WAVES16", bad)
        monkeypatch.setattr(rh, "_WAVES_2BYTE", [])
        with pytest.raises(BadInput, match="TPDIAG_HASH_WAVES16"):
            rh.waves_for(16)
    monkeypatch.setenv("TPDIAG_HASH_WAVES16", "12")
    monkeypatch.setattr(rh, "_WAVES_2BYTE", [])
    assert rh.waves_for(16) == 12 and rh.waves_for(16, records=64) == 12 and rh.waves_for(32) == rh.WAVES
    monkeypatch.delenv("TPDIAG_HASH_WAVES16")
    monkeypatch.setattr(rh, "_WAVES_2BYTE", [])
    # unset: a record alone fills the GPU (FILL_2BYTE per SM); records launched together share it,
    # each keeping WAVES_2BYTE_DEFAULT
    assert rh.waves_for(16) == rh.FILL_2BYTE == 16
    assert rh.waves_for(16, records=2) == 8
    assert rh.waves_for(16, records=64) == rh.WAVES_2BYTE_DEFAULT == 4
