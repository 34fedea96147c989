"""The invariant kernels on CPU: accuracy against float64, and the same bits for any rank split."""
import math

import pytest
import torch

from tpdiag.kernels import grad_norm, tree, vocab_ce
from tpdiag.kernels.grouped_linear import ColLinear, RowLinearPartial, reference_linear
from tpdiag.diff.bits import bitwise_equal


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def simulate_row_parallel(x, w, world, groups=8):
    """What `world` ranks compute: per-rank subtree over its K groups, then the top of the tree."""
    xs, ws = x.chunk(world, -1), w.chunk(world, -1)
    parts = [RowLinearPartial.apply(xr, wr, groups // world) for xr, wr in zip(xs, ws)]
    return tree.tree_sum(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_tree_is_the_same_at_every_split(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 256, generator=g).to(dtype)
    w = torch.randn(96, 256, generator=g).to(dtype)
    ref = simulate_row_parallel(x, w, 1)
    for world in (2, 4, 8):
        assert bitwise_equal(simulate_row_parallel(x, w, world), ref), world
    assert rel(ref, reference_linear(x, w)) < 1e-6


def test_negative_control_plain_partial_sums_differ():
    # the stock row-parallel path: per-rank GEMM, then add the partials
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 512, generator=g), torch.randn(128, 512, generator=g)
    full = x @ w.t()
    differs = []
    for world in (2, 4, 8):
        parts = [xr @ wr.t() for xr, wr in zip(x.chunk(world, -1), w.chunk(world, -1))]
        differs.append(not bitwise_equal(sum(parts[1:], parts[0]), full))
    assert any(differs)


def test_col_parallel_tree_dgrad_same_at_every_split():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=g, requires_grad=True)
    w = torch.randn(128, 64, generator=g)
    dy = torch.randn(16, 128, generator=g)
    outs = {}
    for world in (1, 2, 4, 8):
        parts = []
        for wr, dyr in zip(w.chunk(world, 0), dy.chunk(world, -1)):
            gs, ws = dyr.chunk(8 // world, -1), wr.chunk(8 // world, 0)
            parts.append(tree.tree_sum([a.contiguous() @ b.contiguous() for a, b in zip(gs, ws)]))
        outs[world] = tree.tree_sum(parts)
    for world in (2, 4, 8):
        assert bitwise_equal(outs[world], outs[1])
    # and the autograd Function computes exactly that at world 1
    y = ColLinear.apply(x, w, 8, True, True)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert bitwise_equal(dx, outs[1])


def test_vocab_logprobs_match_float64_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 512, generator=g) * 3
    labels = torch.randint(0, 512, (10,), generator=g)
    labels[-1] = vocab_ce.IGNORE
    lp = vocab_ce.token_logprobs(logits, labels, 8)
    ref = vocab_ce.reference_logprobs(logits, labels)
    assert float((lp.double() - ref).abs().max()) < 1e-5 and lp[-1] == 0
    lo = logits.clone().requires_grad_(True)
    vocab_ce.cross_entropy(lo, labels, 8).backward()
    lo2 = logits.clone().double().requires_grad_(True)
    torch.nn.functional.cross_entropy(lo2, labels, ignore_index=vocab_ce.IGNORE).backward()
    assert float((lo.grad.double() - lo2.grad).abs().max()) < 1e-6


def test_clip_coefficient_is_torchs():
    """A device tensor (no host sync): min(max_norm / (norm + 1e-6), 1) in the dtype asked for,
    exactly torch's expression on that norm; NaN for a NaN norm and 0 for an infinite one."""
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    for dt in (torch.float32, torch.bfloat16):
        for norm in (37.0, 1.116, 3.0, 1e-3 * (1 + 2 ** -40), 1e30):
            c = grad_norm.clip_coefficient(f64(norm), 1.0, dt)
            want = torch.clamp(1.0 / (torch.tensor(norm, dtype=dt) + 1e-6), max=1.0)
            assert c.dtype == dt and c.dim() == 0 and torch.equal(c, want), (dt, norm, c, want)
    # not rounded to a power of two any more: a norm of 1.116 scales by ~0.896, not 0.5
    assert abs(float(grad_norm.clip_coefficient(f64(1.116), 1.0)) - 1 / 1.116) < 1e-6
    assert float(grad_norm.clip_coefficient(f64(0.5), 1.0)) == 1.0
    assert math.isnan(float(grad_norm.clip_coefficient(f64(float("nan")), 1.0)))
    assert float(grad_norm.clip_coefficient(f64(float("inf")), 1.0)) == 0.0


def test_scale_grads_is_torchs_foreach_multiply():
    """scale_grads gives the bits of torch's clip: grad * coefficient tensor, per dtype."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=g).to(dt) for dt in (torch.bfloat16, torch.float32, torch.float16)]
    coef = grad_norm.clip_coefficient(torch.tensor(37.0, dtype=torch.float64), 1.0)
    want = [t.clone().mul_(coef) for t in grads]
    grad_norm.scale_grads(grads, coef)
    assert all(torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32)) for a, b in zip(grads, want))
    assert not torch.equal(grads[1], torch.randn(7, 5, generator=torch.Generator().manual_seed(0)))  # it scaled


def test_tree_rejects_non_power_of_two_tp():
    from tpdiag.errors import BadInput

    with pytest.raises(BadInput):
        tree.check(96, 3, "x")
    with pytest.raises(BadInput):
        tree.check(100, 2, "x")
