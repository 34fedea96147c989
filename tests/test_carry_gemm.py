"""Grad accumulation's fp32 carry at the kernel level: a weight grad accumulated over pieces of
the tokens equals one call over every token, bit for bit (raw bits compared), on the torch (CPU)
path and on the Triton kernels under the interpreter; with acc of zeros the Triton kernel gives
its old (no-acc) bits. Negative controls: the pieces' sums added (what plain gradient
accumulation does), and pieces off the block grid, differ - so the assertions can fail.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from tpdiag.errors import BadInput
from tpdiag.kernels import carry_ops, grad_carry

from conftest import interpreter_result



def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TPDIAG_TRITON_CPU", raising=False)


def operands(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, N, generator=g).to(dtype), torch.randn(M, K, generator=g).to(dtype)


PIECES = [(0, 8), (8, 16), (16, 24), (24, 32)]  # 4 micro-batches of 8 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_wgrad_pieces_equal_whole(dtype):
    g2, x2 = operands(32, 24, 40, dtype)
    whole = torch.zeros(24, 40)
    carry_ops.add_mm(whole, g2, x2)
    pieces = torch.zeros(24, 40)
    for a, b in PIECES:
        carry_ops.add_mm(pieces, g2[a:b], x2[a:b])
    assert same(pieces, whole)
    assert same(pieces.to(dtype), whole.to(dtype))
    # the carry of a column group (a view) gets the same bits as the whole carry's columns
    half = torch.zeros(24, 40)
    carry_ops.add_mm(half[:, :20], g2, x2[:, :20])
    assert same(half[:, :20], whole[:, :20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_wgrad_negative_controls(dtype):
    g2, x2 = operands(32, 24, 40, dtype, seed=1)
    whole = torch.zeros(24, 40)
    carry_ops.add_mm(whole, g2, x2)
    # stock accumulation: one GEMM over every token vs each piece's GEMM, rounded to the dtype
    # and added (what .grad accumulation does) - two orders, other bits
    stock = g2.t() @ x2
    acc = sum(g2[a:b].t() @ x2[a:b] for a, b in PIECES)
    assert not same(acc, stock)
    # pieces off the 8-token block grid: another grouping of the same sum
    ragged = torch.zeros(24, 40)
    for a, b in ((0, 5), (5, 32)):
        carry_ops.add_mm(ragged, g2[a:b], x2[a:b])
    assert not same(ragged, whole)


def test_cpu_colsum_and_rows_pieces_equal_whole():
    g = torch.Generator().manual_seed(2)
    terms = torch.randn(32, 48, generator=g)
    whole, pieces = torch.zeros(48), torch.zeros(48)
    carry_ops.add_colsum(whole, terms)
    for a, b in PIECES:
        carry_ops.add_colsum(pieces, terms[a:b])
    assert same(pieces, whole)
    assert not same(sum(terms[a:b].sum(0) for a, b in PIECES), whole) or not same(
        terms.sum(0), whole)  # at least one plain order differs from the block walk
    idx = torch.randint(0, 6, (32,), generator=g)  # many duplicate rows
    rows = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    whole, pieces = torch.zeros(6, 16), torch.zeros(6, 16)
    carry_ops.add_rows(whole, idx, rows)
    for a, b in PIECES:
        carry_ops.add_rows(pieces, idx[a:b], rows[a:b])
    assert same(pieces, whole)
    plain = sum(torch.zeros(6, 16, dtype=torch.bfloat16).index_add_(0, idx[a:b], rows[a:b]) for a, b in PIECES)
    assert not same(plain, whole.to(torch.bfloat16))


def test_site_refuses_a_piece_after_a_ragged_one():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(BadInput, match="multiple of"):
        with grad_carry.window():
            s = grad_carry.site(w, "w")
            s.walk(5, 8)   # a last piece may be ragged ...
            s.walk(8, 8)   # ... but nothing may follow it
    assert w.grad is None and not grad_carry.is_open()  # dropped, the window closed


def test_window_rounds_once_into_grad():
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with grad_carry.window():
        s = grad_carry.site(w, "w")
        c = s.zeros(w.shape, w.device)
        for _ in range(3):
            c.add_(torch.tensor([1.0, 2.0 ** -9]))  # below bf16's resolution at 1: kept in fp32
    assert same(w.grad, torch.tensor([3.0, 3 * 2.0 ** -9]).to(torch.bfloat16))
    with pytest.raises(BadInput, match="already open"):
        with grad_carry.window():
            with grad_carry.window():
                pass


_INTERP = textwrap.dedent("""
    import dataclasses, json
    import torch
    from tpdiag.kernels import invariant_gemm as ig
    from tpdiag.kernels import carry_ops

    def bits(t):
        return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)

    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))

    res = {}
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        base = ig.INTERPRETER_CONFIGS[dt]          # BLOCK_K 32
        cfgs = {"ptr": base, "tma": dataclasses.replace(base, tma=True)}
        if dt == torch.float32:
            cfgs["bf16x6"] = dataclasses.replace(base, tma=True, epilogue_subtile=True, fp32_precision="bf16x6")
        M, N, K = 128, 40, 24                        # tokens, out rows (N), in cols (K)
        g2 = torch.randn(M, N, generator=g).to(dt)
        x2 = torch.randn(M, K, generator=g).to(dt)
        for name, cfg in cfgs.items():
            key = f"{str(dt)[6:]} {name}"
            old = ig.triton_mm(g2.t(), x2, config=cfg)             # today's wgrad call
            one = torch.zeros(N, K)
            carry_ops.add_mm(one, g2, x2, triton=True, config=cfg)
            pieces = torch.zeros(N, K)
            for a, b in ((0, 32), (32, 96), (96, 128)):           # multiples of BLOCK_K
                carry_ops.add_mm(pieces, g2[a:b], x2[a:b], triton=True, config=cfg)
            ragged = torch.zeros(N, K)
            for a, b in ((0, 20), (20, 128)):
                carry_ops.add_mm(ragged, g2[a:b], x2[a:b], triton=True, config=cfg)
            plain = sum(ig.triton_mm(g2[a:b].t(), x2[a:b], config=cfg) for a, b in ((0, 32), (32, 96), (96, 128)))
            res[key] = {"single == old": same(one.to(dt), old), "pieces == single": same(pieces, one),
                        "ragged differs": not same(ragged, one), "plain differs": not same(plain, old)}
    print("RESULT " + json.dumps(res))
""")


@pytest.fixture(scope="module")
def interp():
    return interpreter_result(_INTERP)


@pytest.mark.parametrize("key", ["float32 ptr", "float32 tma", "float32 bf16x6", "bfloat16 ptr", "bfloat16 tma"])
def test_triton_carry(interp, key):
    r = interp[key]
    assert r["single == old"], "one piece through the carry must keep the old bits"
    assert r["pieces == single"], "pieces on the BLOCK_K grid must continue the walk exactly"
    assert r["ragged differs"] and r["plain differs"], "negative controls: these orders must differ"
