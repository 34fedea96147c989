"""The kernels decode needs, row by row: a token's bits must not depend on how many rows or queries
share its call. Checked on raw bits, each with a negative control (the stock kernel differs).

- kernels/row_blocks.py (the linear fixes' CPU GEMMs): a row alone (a decode step, M = 1 or 2)
  is the same bits as that row inside a prefill's M rows; plain BLAS is not (MKL fp32 takes
  another path below 4 rows).
- invariant attention, torch path (CPU) and Triton path (under TRITON_INTERPRET=1): one query
  over a cache of t + 1 keys gives row t of causal prefill attention; so does a chunk of queries
  after a cache (an explicit bottom-right mask); stock SDPA does not.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def beq(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_a_row_alone_is_its_bits_in_any_batch(dtype):
    from tpdiag.kernels.row_blocks import ROWS, reference_mm, row_blocked_mm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3 * ROWS + 5, 256, generator=g).to(dtype)
    b = torch.randn(256, 64, generator=g).to(dtype)
    full = row_blocked_mm(a, b)
    for i, j in [(0, 1), (7, 8), (ROWS, ROWS + 2), (5, 5 + ROWS), (3, 3 * ROWS + 5), (40, 41)]:
        assert beq(row_blocked_mm(a[i:j], b), full[i:j]), (i, j)
    assert beq(row_blocked_mm(a.view(1, -1, 256), b)[0], full)  # leading dims are rows
    ref = reference_mm(a, b)
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        # negative control: plain BLAS gives a row alone other bits than inside 32 rows
        plain = a[:32] @ b
        assert any(not beq(a[i:i + 1] @ b, plain[i:i + 1]) for i in range(32))


def _qkv(dtype, L=37, H=4, Hk=2, D=16, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hk, L, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_decode_query_is_its_prefill_row(dtype):
    from tpdiag.kernels.attention import invariant_sdpa

    q, k, v = _qkv(dtype)  # 37 keys: two whole key blocks and a partial one
    L = q.shape[2]
    pre = invariant_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    stock_pre = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    stock_same = []
    for t in range(L):
        one = invariant_sdpa(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], enable_gqa=True)
        assert beq(one, pre[:, :, t:t + 1]), t
        stock = F.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                               enable_gqa=True)
        stock_same.append(beq(stock, stock_pre[:, :, t:t + 1]))
    # a chunk of 5 queries after a cache of 20 (chunked prefill): bottom-right causal mask
    mask = torch.arange(25)[None, :] <= torch.arange(20, 25)[:, None]
    chunk = invariant_sdpa(q[:, :, 20:25], k[:, :, :25], v[:, :, :25], attn_mask=mask, enable_gqa=True)
    assert beq(chunk, pre[:, :, 20:25])
    if dtype == torch.float32:
        assert not all(stock_same)  # negative control: the stock CPU kernel is not row-invariant


def test_torch_attention_padding_mask_rows_match():
    """Left padding (generate()'s mask, a key that is padding masked for every query): a
    decode query over the cache gives the row of the masked prefill; fully masked rows are 0."""
    from tpdiag.kernels.attention import invariant_sdpa

    q, k, v = _qkv(torch.float32, L=12)
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False  # sequence 1 left-padded by 3
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    full_mask = (causal[None] & pad[:, None, :])[:, None]  # [B, 1, L, S]
    pre = invariant_sdpa(q, k, v, attn_mask=full_mask, enable_gqa=True)
    assert torch.equal(pre[1, :, :3], torch.zeros_like(pre[1, :, :3]))
    for t in range(3, 12):
        one = invariant_sdpa(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                             attn_mask=pad[:, None, None, :t + 1], enable_gqa=True)
        assert beq(one, pre[:, :, t:t + 1]), t


TRITON_SCRIPT = r"""
import json, torch
from tpdiag.kernels import attention_triton as at
def bits(t): return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
def beq(a, b): return a.shape == b.shape and torch.equal(bits(a), bits(b))
g = torch.Generator().manual_seed(0)
cfg = at.AttnConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
res = {}
for dt in (torch.float32, torch.bfloat16):
    L = 37  # key blocks of 16: two whole, one partial
    q = torch.randn(1, 4, L, 16, generator=g).to(dt)
    k, v = (torch.randn(1, 2, L, 16, generator=g).to(dt) for _ in range(2))
    pre, _ = at.forward(q, k, v, True, 0.25, cfg)
    res[str(dt)] = [beq(at.forward(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], False, 0.25, cfg)[0],
                        pre[:, :, t:t + 1]) for t in range(L)]
    # negative control: other key tiles are another reduction order
    other = at.AttnConfig(16, 8, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
    res[str(dt) + " other tiles"] = all(beq(at.forward(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], False,
                                                       0.25, other)[0], pre[:, :, t:t + 1]) for t in range(L))
print("RESULT", json.dumps(res))
"""


def test_triton_attention_decode_query_is_its_prefill_row():
    """The Triton kernel needs no change for decode: one query (non-causal, over t + 1 keys)
    walks the same key blocks from 0 in the same order as row t of the causal prefill, its
    masked keys exact zeros. Under the interpreter, fp32 and bf16."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.split("RESULT", 1)[1])
    for dt in ("torch.float32", "torch.bfloat16"):
        assert all(res[dt]), (dt, res[dt])
    assert not res["torch.float32 other tiles"]
