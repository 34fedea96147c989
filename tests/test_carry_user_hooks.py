"""A user's own grad hook on a parameter (`p.register_hook`, how hand-written TP code sums a replicated
weight's grads over the ranks) inside grad accumulation's fp32 carry (kernels/grad_carry.py, helper
hred14). A carried use returns None for the weight, so the hook was called with None - the planted
context_parallel.py:cp_offset's confirmation rerun under invariant-gemm died in its hook
(AttributeError) - and a hook that changes the grad was skipped: the carry reached .grad without
it. Now a hooked parameter keeps the stock grad, which its hook sees and changes (and
accumulate_grads says it was not carried). Fails on the old code: the hook saw None, the grad was
not doubled."""
import warnings

import torch
from torch import nn

import tpdiag


def _grad(hook):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    seen = []

    def h(g):
        seen.append(g)
        return hook(g)
    lin.weight.register_hook(h)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NotCarried: the hooked weight's grad is outside the carry
        with tpdiag.invariant(lin, {}, fixes="invariant-gemm", tree_groups=1):
            with tpdiag.accumulate_grads(lin):
                lin(x).sum().backward()
    return seen, lin.weight.grad


def test_a_hook_on_a_carried_weight_sees_its_grad_and_its_change_is_kept():
    seen, doubled = _grad(lambda g: g * 2)
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor), seen
    _, plain = _grad(lambda g: g)
    assert torch.equal(doubled, plain * 2)
    assert torch.equal(seen[0], plain)


def test_the_hooked_weight_is_named_as_not_carried():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    lin.weight.register_hook(lambda g: g)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with tpdiag.invariant(lin, {}, fixes="invariant-gemm", tree_groups=1):
            with tpdiag.accumulate_grads(lin):
                lin(torch.randn(2, 8, 8)).sum().backward()
    assert any("outside the fp32 carry" in str(w.message) and "weight" in str(w.message) for w in got), \
        [str(w.message) for w in got]


def _parametrized_grad(window: bool):
    from contextlib import nullcontext

    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return w * 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    parametrize.register_parametrization(model[0], "weight", Doubled())
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with tpdiag.invariant(model, {}, fixes="invariant-gemm", tree_groups=1):
            with tpdiag.accumulate_grads(model) if window else nullcontext():
                model(x).pow(2).sum().backward()
    return model[0].parametrizations.weight.original.grad, [str(w.message) for w in got]


def test_a_parametrized_weight_gets_its_grad_under_the_carry():
    """A weight a parametrization computes is no leaf: its carry went into the .grad of a tensor no
    optimizer holds and `parametrizations.weight.original` got NO grad (hred15: None on the old code).
    It gets the grad through the parametrization now - the one the fixes give outside a window, up to
    the order the window's kernels sum the downstream layer's dgrad in (fp32) - and is named as not
    carried."""
    carried, said = _parametrized_grad(True)
    plain, _ = _parametrized_grad(False)
    assert carried is not None and plain is not None and bool(plain.ne(0).any())
    assert torch.allclose(carried, plain, rtol=1e-5, atol=0), (carried - plain).abs().max()
    assert any("outside the fp32 carry" in m and "parametrizations.weight.original" in m for m in said), said
