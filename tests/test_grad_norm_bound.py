"""The grad norm's triangle bound needs every grad the norm read (hash capture keeps some)."""
import torch

from tpdiag.diff.engine import DegreeDiff
from tpdiag.diff.loss_bounds import loss_bounds as _loss_bounds


def _rows():
    return [{"key": f"s0/backward/l{i}/param_grad#0/weight", "kind": "param_grad", "step": 0} for i in range(2)] + \
           [{"key": "s0/optimizer/model/grad_norm#0/total", "kind": "grad_norm", "step": 0}]


def _tensors(keep_both: bool):
    g0 = torch.ones(4)
    g1a, g1b = torch.zeros(4), torch.full((4,), 1e-3)  # the second grad differs
    t = {"s0/backward/l0/param_grad#0/weight": (g0, g0.clone()),
         "s0/optimizer/model/grad_norm#0/total": (torch.tensor(torch.cat([g0, g1a]).norm().item()),
                                                   torch.tensor(torch.cat([g0, g1b]).norm().item()))}
    if keep_both:
        t["s0/backward/l1/param_grad#0/weight"] = (g1a, g1b)
    return t


def test_bound_from_every_grad_holds():
    dd = DegreeDiff("2", _rows(), [], [], tensors=_tensors(True))
    _loss_bounds(dd)
    assert dd.rows[2]["beyond_bound"] is False


def test_no_bound_when_a_grad_has_no_whole_value():
    # the kept grad is equal on both sides: a bound over it alone is rounding-sized, and the
    # norm's real difference (from the grad hash capture did not keep) looked like a bug
    dd = DegreeDiff("2", _rows(), [], [], tensors=_tensors(False))
    _loss_bounds(dd)
    assert "bound" not in dd.rows[2] and not dd.rows[2].get("beyond_bound")


def test_a_norm_that_counted_a_grad_twice_is_beyond_its_bound_and_far():
    # each grad pair read once for both measures (bounds.grad_sums): a wrong norm is still one
    g0 = torch.ones(4)
    g1a, g1b = torch.zeros(4), torch.full((4,), 1e-3)
    t = _tensors(True)
    t["s0/optimizer/model/grad_norm#0/total"] = (torch.tensor(torch.cat([g0, g1a]).norm().item()),
                                                 torch.tensor(torch.cat([g0, g0, g1b]).norm().item()))
    dd = DegreeDiff("2", _rows(), [], [], tensors=t)
    _loss_bounds(dd)
    assert dd.rows[2]["beyond_bound"] is True and dd.rows[2]["norm_own"]["far"] is True


def test_sums_read_once_give_each_measure_its_own_numbers():
    """norm_bound and norm_own_errors from grad_sums are, bit for bit, what each computes alone
    (the same float64 expressions, summed in the same order) - a pair of two dtypes included."""
    from tpdiag.diff import bounds

    g = torch.Generator().manual_seed(0)
    g1 = [torch.randn(s, generator=g) for s in ((64, 32), (32,), (128, 16))]
    gn = [(x.double() * (1 + 1e-3 * torch.randn(x.shape, generator=g, dtype=torch.float64))).float() for x in g1]
    g1[1], gn[1] = g1[1].to(torch.bfloat16), gn[1].double()  # one pair of two dtypes
    a, b = 12.5, 12.5004
    sums = bounds.grad_sums(g1, gn)
    assert bounds.norm_bound(g1, gn, a, b, sums) == bounds.norm_bound(g1, gn, a, b)
    assert bounds.norm_own_errors(g1, gn, a, b, sums) == bounds.norm_own_errors(g1, gn, a, b)
