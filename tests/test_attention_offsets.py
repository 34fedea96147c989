"""invariant-attention's row offsets past 2^31 elements (Triton interpreter, CPU): q in
[B, L, H, D] memory - the layout `x.view(B, L, H, D).transpose(1, 2)` gives - has a row stride of
H * D, so one batch row passes 2^31 elements at L = 2^18 + 16, H = 64, D = 128. The 4 GiB buffer
is never touched but for its last rows (untouched pages cost no memory), and only the last row
block is launched. Negative control: the same kernel with int32 row offsets (`wide` made to say
no) reads elsewhere."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
import torch, triton
from tpdiag.kernels import attention_triton as at
if sys.argv[1] == "int32":  # the negative control: the row offsets before the fix
    sys.path.insert(0, "tests")
    from module_copy import patched
    at = patched(at, "return any((t.shape[-2] + 256) * t.stride(-2) >= 2**31 for t in ts)", "return False", "at_int32")
print("LOADED", flush=True)
L, H, D, S, BM = 2**18 + 16, 64, 128, 16, 16
buf = torch.empty(1, L, H, D, dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
buf[0, -BM:, 0] = torch.randn(BM, D, generator=g).bfloat16()  # the last block's rows of head 0
q = buf.transpose(1, 2)[:, :1]  # [1, 1, L, D], row stride H * D
assert buf.numel() > 2**31 and q.stride(2) == H * D and at.wide(q) != (sys.argv[1] == "int32")
k, v = (torch.randn(1, 1, S, D, generator=g).bfloat16() for _ in range(2))
cfg = at.AttnConfig(BM, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, fwd_tma=False)
o = torch.zeros(1, 1, L, D, dtype=q.dtype)
lse = torch.zeros(1, L)
# grid of one: program 0 is the last row block (heaviest first)
at._fwd_kernel[(1,)](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                     1, 1, L, S, 0.125 * at.LOG2E, triton.cdiv(L, BM), 1, 1,
                     CAUSAL=False, BM=BM, BN=16, D=D, PREC=at._prec(q), EVEN=True, TMA=False, I64=at.wide(q, k, v))
alone, lse_alone = at.forward(q[:, :, -BM:].contiguous(), k, v, False, 0.125, cfg)
print("RESULT", json.dumps({"o": torch.equal(o[:, :, -BM:].view(torch.int16), alone.view(torch.int16)),
                            "lse": torch.equal(lse[:, -BM:], lse_alone)}))
"""


def _run(mode):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_rows_past_2_31_elements_read_their_own_memory():
    p = _run("int64")
    if p.returncode and ("MemoryError" in p.stderr or "DefaultCPUAllocator" in p.stderr):
        pytest.skip("this host will not map a 4 GiB buffer")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.split("RESULT", 1)[1]) == {"o": True, "lse": True}
    # negative control: int32 row offsets wrap and read other memory (a crash, or other values)
    bad = _run("int32")
    assert "LOADED" in bad.stdout, bad.stderr[-2000:]
    assert bad.returncode != 0 or json.loads(bad.stdout.split("RESULT", 1)[1]) != {"o": True, "lse": True}


def test_wide_only_where_a_row_offset_can_pass_int32():
    pytest.importorskip("triton")
    import torch

    from tpdiag.kernels import attention_triton as at

    def blhd(L):  # [1, 64, L, 128] over [1, L, 64, 128] memory (row stride 8192), no storage
        return torch.empty_strided((1, 64, L, 128), (L * 8192, 128, 8192, 1), device="meta")

    assert not at.wide(torch.empty(8, 64, 16384, 128, device="meta"))  # 2^33 elements, rows of 128
    # rows up to a tile (256) past the end: (L + 255) * 8192 < 2^31 is safe; one more row is not
    assert not at.wide(blhd(2**18 - 257)) and at.wide(blhd(2**18 - 256))
