"""A compare's parent re-hashes the big records it reads on its GPU (records/hashing.checks_on):
a piece at a time, each at its flat offset - the lanes must be the host's, bit for bit."""
import pytest
import torch

from tpdiag.kernels.record_hash_ref import whole_lanes
from tpdiag.records import hashing
from tpdiag.records.hashing import checks_on, device_lanes, tensor_hash

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool]


def _tensor(dt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    return (torch.randn(n, generator=g) * 100).to(dt)


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dt", DTYPES)
def test_pieces_at_offsets_are_the_hosts_lanes(device, dt):
    for n in (1, 7, 4099):
        t = _tensor(dt, n)
        want = whole_lanes(t)
        # one element a piece, a few, pieces that do not divide n, the whole tensor in one piece
        for piece in ((1, 24) if n < 10 else (1000, 3000, 1 << 20)):
            assert device_lanes(t, device, piece=piece) == want, (n, piece)


def test_a_piece_at_the_wrong_offset_is_another_hash():
    # negative control: the offsets are what makes pieces add up to the whole tensor's lanes
    from tpdiag.kernels.record_hash import shard_lanes

    t = _tensor(torch.bfloat16, 4099)
    n, step = t.numel(), 1000
    la = lb = 0
    for s in range(0, n, step):
        ints, _ = shard_lanes(t[s:s + step], 0, n, 0, stats=False)  # every piece at offset 0
        la += int(ints[0])
        lb += int(ints[1])
    assert (la & 0xFFFFFFFF, lb & 0xFFFFFFFF) != whole_lanes(t)
    assert device_lanes(t, "cpu", piece=2 * step) == whole_lanes(t)


def test_tensor_hash_inside_checks_on_is_the_same_and_restored(monkeypatch):
    monkeypatch.setattr(hashing, "_DEVICE_MIN", 0)
    t = _tensor(torch.float32, 3000, seed=3).reshape(30, 100)
    host = tensor_hash(t)
    seen = []
    real = hashing.device_lanes
    monkeypatch.setattr(hashing, "device_lanes", lambda *a, **k: seen.append(a[1]) or real(*a, **k))
    with checks_on(_devices()[-1]):
        assert tensor_hash(t) == host
    assert seen, "the device path was not taken inside checks_on"
    assert hashing._DEVICE[0] is None
    t2 = t.clone()
    t2.view(torch.int32)[7, 3] ^= 1  # one bit
    with checks_on(_devices()[-1]):
        assert tensor_hash(t2) != host


def test_the_parent_checks_on_its_gpu_only_when_it_may(monkeypatch):
    from tpdiag.config import CompareConfig
    from tpdiag.runner.session import _check_device

    assert _check_device(CompareConfig().with_(device="cpu", degrees=(1, 2))) is None
    monkeypatch.setenv("TPDIAG_START_METHOD", "fork")
    assert _check_device(CompareConfig().with_(device="cuda", degrees=(1, 2))) is None
    monkeypatch.setenv("TPDIAG_START_METHOD", "forkserver")
    from tpdiag.base import gpu_shared

    # exclusive-process GPUs (or no driver): a context here would lock rank 0 out of its GPU
    monkeypatch.setattr(gpu_shared, "shareable", lambda ordinal=0: False)
    assert _check_device(CompareConfig().with_(device="cuda", degrees=(1, 2))) is None
    monkeypatch.setattr(gpu_shared, "shareable", lambda ordinal=0: True)
    assert _check_device(CompareConfig().with_(device="cuda", degrees=(1, 2))) == "cuda:0"
    monkeypatch.setenv("TPDIAG_CHECK_DEVICE", "cpu")
    assert _check_device(CompareConfig().with_(device="cuda", degrees=(1, 2))) is None
    from tpdiag.errors import BadInput

    monkeypatch.setenv("TPDIAG_CHECK_DEVICE", "gpu")
    with pytest.raises(BadInput, match="expected auto or cpu"):
        _check_device(CompareConfig().with_(device="cuda", degrees=(1, 2)))


def test_no_driver_reads_as_not_shareable():
    from tpdiag.base.gpu_shared import shareable

    if not torch.cuda.is_available():
        assert shareable(0) is False
        return
    import shutil
    import subprocess

    import os

    if not shutil.which("nvidia-smi") or os.environ.get("CUDA_VISIBLE_DEVICES"):
        pytest.skip("no nvidia-smi, or another GPU order than nvidia-smi's, to read the compute mode from")
    first = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout.split()[0]
    assert shareable(0) is (first == "Default")


def test_a_device_that_fails_falls_back_to_the_host(monkeypatch):
    # the parent's GPU full (a world's memory) or a driver error: the check still runs, on the host
    monkeypatch.setattr(hashing, "_DEVICE_MIN", 0)
    t = _tensor(torch.bfloat16, 5000, seed=5)
    host = tensor_hash(t)

    def full(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(hashing, "device_lanes", full)
    with checks_on("cpu"):
        assert tensor_hash(t) == host
        assert hashing._DEVICE[0] is None  # not tried again inside the block
    assert hashing._DEVICE[0] is None
