"""The record hash's lane mix (kernels/record_hash.py, version 2): structured perturbations of the
kind TP runs produce collide in the lanes truncated to 8 bits no more often than a random
function's would (a weak, linear mix fails the same test), version 1 stays bit-identical for the
benchmarks' A/B, and run directories say which mix made their hashes: two versions are never
compared, an old (unversioned) directory is read as version 1."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_cli
from tpdiag.kernels import record_hash as rh
from tpdiag.kernels.record_hash_ref import C1, C2, M32, mix_torch

T, ROWS, COLS = 10000, 16, 16  # trials of a [16, 16] bf16 tensor
N = ROWS * COLS


def _lanes(w: torch.Tensor, mix) -> tuple[torch.Tensor, torch.Tensor]:
    """Lanes of T tensors at once: w [T, N] int64 words; mix: a version, or a function of y."""
    k = torch.arange(N, dtype=torch.int64)
    y = (w * C1 + k * C2) & M32
    x, f = mix(y) if callable(mix) else mix_torch(y, mix)
    return x.sum(1) & M32, (x * f).sum(1) & M32


def _bf16_words(gen) -> torch.Tensor:
    return torch.randn(T, N, generator=gen).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _balanced_ulps(gen):
    """16 elements one ULP up and 16 one ULP down (raw bits +-1): the sum of the words is unchanged,
    as when two reduction orders round differently."""
    w = _bf16_words(gen)
    idx = torch.rand(T, N, generator=gen).argsort(1)[:, :32]
    d = torch.tensor([1, -1] * 16, dtype=torch.int64).expand(T, 32)
    w2 = w.clone()
    w2.scatter_(1, idx, (w.gather(1, idx) + d) & 0xFFFF)
    return w, w2


def _row_permutation(gen):
    w = _bf16_words(gen)
    p = torch.rand(T, ROWS, generator=gen).argsort(1)
    w2 = w.view(T, ROWS, COLS).gather(1, p[:, :, None].expand(T, ROWS, COLS)).reshape(T, N)
    return w, w2


WINDOWS = ((0, 8), (24, 32))  # low and high 8 bits of each lane


def _collisions(perturb, mix, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w, w2 = perturb(gen)
    keep = (w != w2).any(1)  # a permutation that left the tensor as it was is no change
    a1, b1 = _lanes(w[keep], mix)
    a2, b2 = _lanes(w2[keep], mix)
    out = {}
    for lane, (l1, l2) in (("a", (a1, a2)), ("b", (b1, b2))):
        for lo, hi in WINDOWS:
            m = (1 << (hi - lo)) - 1
            out[f"{lane}[{lo}:{hi}]"] = int((((l1 >> lo) & m) == ((l2 >> lo) & m)).sum())
    return out, int(keep.sum())


def _linear(y):
    return y, y


@pytest.mark.parametrize("perturb", [_balanced_ulps, _row_permutation])
def test_truncated_lanes_collide_like_a_random_function(perturb):
    got, n = _collisions(perturb, rh.HASH_VERSION)
    want = n / 256  # a random function: an 8-bit window is unchanged with probability 2**-8
    for window, c in got.items():
        assert abs(c - want) < 5 * want ** 0.5, (perturb.__name__, window, c, want, got)
    # the vectorised lanes are lanes_torch's (the definition the kernels match bit for bit)
    gen = torch.Generator().manual_seed(0)
    w, _ = perturb(gen)
    t = w[:3].to(torch.int16).view(torch.bfloat16).reshape(3, ROWS, COLS)
    a, b = _lanes(w[:3], rh.HASH_VERSION)
    for i in range(3):
        ints, _ = rh.lanes_torch(t[i], *rh.slab(t[i].shape, None, None, 0))
        assert (int(ints[0]) & M32, int(ints[1]) & M32) == (int(a[i]), int(b[i]))


def test_a_linear_mix_fails_the_balanced_ulp_test():
    # negative control: x = w * C1 + k * C2 alone is blind to changes whose raw bits sum to zero
    got, n = _collisions(_balanced_ulps, _linear)
    assert got["a[0:8]"] == got["a[24:32]"] == n, got


def test_version_1_is_the_first_mix_bit_for_bit():
    """mix=1 (kept for old run directories and the benchmarks' A/B): the same lanes as before
    the mix was versioned (values computed with the first definition, main 2026-11-23), and the
    Triton kernel (interpreter) matches the torch path in both versions incl. bf16 word pairs."""
    full = torch.arange(-40, 56, dtype=torch.float32).reshape(4, 24).to(torch.bfloat16) / 8
    assert rh.reference_lanes(full, 1) == (2744969349, 3678451761)
    assert rh.reference_lanes(full, 2) != rh.reference_lanes(full, 1)
    code = r"""
import torch
from tpdiag.kernels import record_hash as rh
torch.manual_seed(0)
for dt, shape in ((torch.bfloat16, (4, 8, 64)), (torch.float32, (2, 8, 40))):
    full = torch.randn(*shape).to(dt)
    for dim in (None, 2):
        p = full if dim is None else full.chunk(2, dim=dim)[1].contiguous()
        args = rh.slab(p.shape, dim, None if dim is None else shape[dim], 0 if dim is None else p.shape[dim])
        for mix in (1, 2):
            ia, _ = rh.lanes_torch(p, *args, mix=mix)
            ia[:2] &= rh.M32
            for pairs in (False, True):  # both 16-bit paths, explicitly (word pairs: the default)
                ib, _ = rh.triton_lanes(p, *args, mix=mix, pairs=pairs)
                ib[:2] &= rh.M32
                assert torch.equal(ia, ib), (dt, dim, mix, pairs, ia, ib)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def _unversioned_copy(src, dst):
    """An old run directory's degree: no hash_version, stored tensors' hashes made with mix 1."""
    from safetensors.torch import load_file

    from tpdiag.records.hashing import tensor_hash

    shutil.copytree(src, dst)
    w = json.loads((dst / "world.json").read_text())
    del w["hash_version"]
    (dst / "world.json").write_text(json.dumps(w))
    tensors = load_file(str(dst / "records.safetensors"))
    lines = []
    for line in (dst / "events.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("stored_hash") is not None:
            m["stored_hash"] = tensor_hash(tensors[str(m["idx"])], 1)
        lines.append(json.dumps(m))
    (dst / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_run_directories_record_the_hash_version(stock_run, tmp_path):
    from tpdiag.errors import Inconclusive
    from tpdiag.records.store import RecordSet

    assert json.loads((stock_run / "manifest.json").read_text())["hash_version"] == rh.HASH_VERSION
    assert RecordSet(str(stock_run / "tp2")).hash_version == rh.HASH_VERSION
    old = tmp_path / "old" / "tp2"
    _unversioned_copy(stock_run / "tp2", old)
    rs = RecordSet(str(old))
    assert rs.hash_version == 1
    checked = [m for m in rs.events if m.get("stored_hash")][:3]
    assert checked
    for m in checked:  # read as version 1: its stored tensors match their (version 1) hashes
        rs.tensor(m)
    # negative control: the same files claiming the current version are caught as edited
    w = json.loads((old / "world.json").read_text())
    (old / "world.json").write_text(json.dumps({**w, "hash_version": rh.HASH_VERSION}))
    with pytest.raises(Inconclusive, match="does not match its hash"):
        RecordSet(str(old)).tensor(checked[0])
    (old / "world.json").write_text(json.dumps(w))
    # a diff of two hash versions is refused in one line (exit 2), not reported as differences
    p = run_cli("diff", str(stock_run / "tp2"), str(old), "--out", str(tmp_path / "d"))
    assert p.returncode == 2, p.stderr + p.stdout
    assert "record hashes not comparable" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "d").exists()
