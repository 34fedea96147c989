"""invariant-attention on a CUDA GPU (skipped elsewhere): the TMA descriptor paths give the pointer
loads' bits - forward (fwd_tma) and backward loops (bwd_tma) - at the shipped tiles, with uneven
lengths, GQA and q/k/v in [B, L, H, D] memory; and rows past 2^31 elements of one batch row read
their own memory on the GPU too (tests/test_attention_offsets.py is the interpreter's check).
Run on an H200 at b4b07e9 (with all 12 cases of a wider grid): 3 TMA/pointer cases passed before a
170 s limit; the rest and the 2^31 case were not reached - not run to the end on a GPU yet. The
fused and mixed backwards' cases (bwd_fused, ds_every; 2026-11-29): not run on a GPU yet; nor
the exp2-by-polynomial cases (exp_soft, 2026-11-30; their bodies ran under the interpreter at
L = 40 only)."""
from dataclasses import replace

import pytest
import torch

# CUDA first: importing triton at collection without TRITON_INTERPRET would leave the in-process
# interpreter tests (test_tree_gemm.py) with compiled-mode triton.language
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb  # noqa: E402
from tpdiag.kernels.exp2_soft import exp2_mixed  # noqa: E402


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _beq(a, b):
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _blhd(B, L, H, D, dtype, g):
    return torch.randn(B, L, H, D, generator=g, device="cuda").to(dtype).transpose(1, 2)


@pytest.mark.parametrize("D,dtype,L,S,causal", [(64, torch.bfloat16, 1000, 1000, True), (128, torch.bfloat16, 1000, 1000, True),
                                                (128, torch.bfloat16, 384, 1000, False), (64, torch.float32, 1000, 384, True)])
def test_tma_paths_give_the_pointer_bits(D, dtype, L, S, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = _blhd(2, L, 8, D, dtype, g), torch.randn(2, 8, L, D, generator=g, device="cuda").to(dtype)
    k, v = _blhd(2, S, 4, D, dtype, g), _blhd(2, S, 4, D, dtype, g)
    cfg = at.config_for(dtype, D)
    tma, ptr = replace(cfg, fwd_tma=True, bwd_tma=True), replace(cfg, fwd_tma=False, bwd_tma=False)
    if torch.cuda.get_device_capability()[0] < 9 or not at.tma_ok(q, k, v, do):
        pytest.skip("no TMA on this GPU or Triton")
    o, lse = at.forward(q, k, v, causal, D ** -0.5, tma)
    o2, lse2 = at.forward(q, k, v, causal, D ** -0.5, ptr)
    assert _beq(o, o2) and _beq(lse, lse2)
    for c in (cfg, replace(cfg, ds_mib=0 if cfg.ds_mib else 2048)):  # both dq paths
        a = atb.backward(do, q, k, v, o, lse, causal, D ** -0.5, replace(c, bwd_tma=True))
        b = atb.backward(do, q, k, v, o, lse, causal, D ** -0.5, replace(c, bwd_tma=False))
        assert all(_beq(x, y) for x, y in zip(a, b))


def test_rows_past_2_31_elements():
    # q in [1, L, 64, 128] memory: the row stride 8192 takes one batch row past 2^31 elements;
    # few keys, so the work is small. The last rows, computed alone, give the same bits.
    L, H, D, S, tail = 2**18 + 16, 64, 128, 128, 272
    if torch.cuda.get_device_properties(0).total_memory < 48 * 2**30:
        pytest.skip("needs ~25 GiB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = _blhd(1, L, H, D, torch.bfloat16, g)
    assert q.untyped_storage().nbytes() // 2 > 2**31
    k, v = _blhd(1, S, H, D, torch.bfloat16, g), _blhd(1, S, H, D, torch.bfloat16, g)
    do = torch.randn(1, H, L, D, generator=g, device="cuda").bfloat16()
    cut = lambda t: t[:, :, -tail:].contiguous()  # noqa: E731 (tail: a multiple of every row tile)
    shipped = at.config_for(q.dtype, D)
    for cfg in (shipped, replace(shipped, fwd_tma=False, bwd_tma=False), replace(shipped, fwd_tma=False, ds_mib=0)):
        o, lse = at.forward(q, k, v, False, 0.1, cfg)
        o1, lse1 = at.forward(cut(q), k, v, False, 0.1, cfg)
        assert _beq(o1, cut(o)) and _beq(lse1, lse.view(1, H, L)[:, :, -tail:].reshape(H, tail))
        dq = atb.backward(do, q, k, v, o, lse, False, 0.1, cfg)[0]
        dq1 = atb.backward(cut(do), cut(q), k, v, o1, lse1, False, 0.1, cfg)[0]
        assert _beq(dq1, cut(dq))
        del o, lse, dq


@pytest.mark.parametrize("D,L,causal", [(64, 1000, True), (64, 4096, True), (128, 1000, False)])
def test_fused_backward_gives_the_two_launch_bits(D, L, causal):
    """bwd_fused on the GPU: one launch of the dk/dv and dq programs after the delta pass gives the
    two-launch recompute path's bits at the shipped tiles (delta from its own pass, not the dq
    pass's: the interpreter cannot tell those apart), and keeps the TP=2 head slices' bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(2, 8, L, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 4, L, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    cfg = replace(at.config_for(torch.bfloat16, D), ds_mib=0)
    o, lse = at.forward(q, k, v, causal, D ** -0.5, cfg)
    two = atb.backward(do, q, k, v, o, lse, causal, D ** -0.5, cfg)
    one = atb.backward(do, q, k, v, o, lse, causal, D ** -0.5, replace(cfg, bwd_fused=True))
    assert all(_beq(x, y) for x, y in zip(one, two))
    half = atb.backward(do[:, 4:], q[:, 4:], k[:, 2:], v[:, 2:], o[:, 4:].contiguous(),
                        lse.view(2, 8, L)[:, 4:].reshape(8, L), causal, D ** -0.5, replace(cfg, bwd_fused=True))
    assert all(_beq(x, y) for x, y in zip(half, (one[0][:, 4:], one[1][:, 2:], one[2][:, 2:])))


@pytest.mark.parametrize("every", [2, 4])
def test_mixed_backward_gives_the_stored_ds_bits(every):
    """ds_every on the GPU: dS kept for every 2nd / 4th key block, the rest recomputed by dq, gives
    the stored-dS path's bits (and so the recompute path's, where those two agree) at the D=64
    tiles, chunked or not."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(2, 8, 1000, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 4, 1000, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
    cfg = replace(at.config_for(torch.bfloat16, 64), ds_mib=2048)
    o, lse = at.forward(q, k, v, True, 0.125, cfg)
    ref = atb.backward(do, q, k, v, o, lse, True, 0.125, cfg)
    mix = atb.backward(do, q, k, v, o, lse, True, 0.125, replace(cfg, ds_every=every))
    assert all(_beq(x, y) for x, y in zip(mix, ref))
    nan = atb._backward_ds(do.contiguous(), q, k, v, o, lse, True, 0.125, replace(cfg, ds_every=every), chunk=1,
                           ds=torch.full((2, 1000, 1000), float("nan"), device="cuda", dtype=torch.bfloat16))
    assert all(_beq(x, y) for x, y in zip(nan, mix))


@triton.jit
def _exp2_tile(X, Y, R: tl.constexpr, C: tl.constexpr, EVERY: tl.constexpr, DEG: tl.constexpr):
    o = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(Y + o, exp2_mixed(tl.load(X + o), R, C, EVERY, DEG))


def test_soft_exp2_columns_and_error_on_the_gpu():
    """exp2_mixed compiled (AttnConfig.exp_soft), on a loaded tile: the columns the interpreter's
    tests check take the polynomial, the rest the MUFU's bits; and the polynomial's error against
    float64 within the bound the interpreter holds it to (its Horner steps are FMAs here)."""
    from tpdiag.kernels.exp2_soft import MAX_REL_ERR

    def run(x, every, deg):
        y = torch.empty_like(x)
        _exp2_tile[(1,)](x, y, x.shape[0], x.shape[1], every, deg, num_warps=4)
        return y

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(256, 64, generator=g, device="cuda") * -40 + 2
    ref = torch.exp2(x.double())
    for deg in (3, 4, 5):
        assert float(((run(x, 1, deg).double() - ref).abs() / ref).max()) <= MAX_REL_ERR[deg]
    mufu, poly = run(x, 0, 3), run(x, 1, 3)
    c = torch.arange(64, device="cuda")
    for every, cols in ((2, c % 2 == 1), (4, torch.isin(c % 16, torch.tensor([9, 11, 13, 15], device="cuda")))):
        y = run(x, every, 3)
        assert torch.equal(y[:, cols], poly[:, cols]) and torch.equal(y[:, ~cols], mufu[:, ~cols])


@pytest.mark.parametrize("changes", [dict(exp_soft=3, exp_soft_every=4), dict(exp_soft=7, exp_soft_every=2),
                                     dict(exp_soft=3, exp_soft_every=2, exp_soft_deg=5)])
def test_soft_exp2_attention_stays_invariant_and_accurate(changes):
    """exp_soft at the shipped D=64 tiles on the GPU (the benchmark's candidates): the TP=2 head
    slices, a batch row and a rerun bitwise, and o, dq, dk, dv within the interpreter tests' bf16
    tolerance of float64 attention."""
    from tpdiag.kernels.attention import reference_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    L = 1000
    q, do = (torch.randn(2, 8, L, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 4, L, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
    cfg = replace(at.config_for(torch.bfloat16, 64), **changes)

    def both(q, k, v, do):
        o, lse = at.forward(q, k, v, True, 0.125, cfg)
        return (o,) + tuple(atb.backward(do, q, k, v, o, lse, True, 0.125, cfg))

    full = both(q, k, v, do)
    half = both(q[:, 4:], k[:, 2:], v[:, 2:], do[:, 4:])
    assert all(_beq(x, y) for x, y in zip(half, (full[0][:, 4:], full[1][:, 4:], full[2][:, 2:], full[3][:, 2:])))
    assert all(_beq(x, y[1:]) for x, y in zip(both(q[1:], k[1:], v[1:], do[1:]), full))
    assert all(_beq(x, y) for x, y in zip(both(q, k, v, do), full))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    r = reference_sdpa(q64, k64, v64, is_causal=True, scale=0.125, enable_gqa=True)
    r.backward(do.double())
    for a, b in zip(full, (r.detach(), q64.grad, k64.grad, v64.grad)):
        assert float((a.double() - b).abs().max() / b.abs().max()) < 2e-2
