"""A user's model that scales a Linear's output in place, as transformers' Gemma3n does
(`per_layer_projection = self.per_layer_model_projection(x); per_layer_projection *= scale`):
under the fixes that Linear's output came from an autograd Function that returned a reshape of its
own GEMM result - a view - and autograd forbids modifying a custom Function's view output in place,
so `tpdiag compare --fix all` on a Gemma3n checkpoint failed at TP=1 ("Output 0 of CarryLinear is a
view and is being modified inplace"). The fixed GEMMs now return their result in the caller's shape
without a view (aten's own matmul does the same), the bits unchanged: the in-place scale runs, and
the weight's grad is the same bits as the stock model's computed the same way out of place."""
import torch
from torch import nn

from tpdiag.fixes import linear, state
from tpdiag.kernels import grad_carry


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 48, bias=False)
        self.register_buffer("scale", torch.tensor(64 ** -0.5))

    def forward(self, x):
        y = self.proj(x)
        y *= self.scale  # the user's in-place scale
        return y.reshape(*x.shape[:-1], 4, 12)


def _run(model, x, fixed: bool):
    model.zero_grad(set_to_none=True)
    if not fixed:
        out = model(x)
        (out.float() ** 2).sum().backward()
        return out.detach(), model.proj.weight.grad.clone()
    with linear.linear_fix(linear.BLOCKED, model, {}, 1), state.flag(linear.BLOCKED):
        with grad_carry.window():
            out = model(x)
            (out.float() ** 2).sum().backward()
    return out.detach(), model.proj.weight.grad.clone()


def test_a_fixed_linears_output_can_be_scaled_in_place():
    torch.manual_seed(0)
    model = Projection()
    x = torch.randn(2, 5, 64)  # 10 rows: not a multiple of the CPU row blocks (a sliced result)
    out, grad = _run(model, x, fixed=True)
    # the same forward bits as the fixed GEMM's out-of-place: the in-place op is the user's
    from tpdiag.kernels.grouped_linear import _mm

    want = _mm(x, model.proj.weight.t().contiguous()) * model.scale
    assert torch.equal(out, want.reshape(2, 5, 4, 12))
    assert grad.shape == model.proj.weight.shape and torch.isfinite(grad).all()
    # the stock model takes the same in-place op (its F.linear is aten's matmul: no view)
    ref, _ = _run(model, x, fixed=False)
    assert torch.allclose(out, ref, atol=1e-5)


def test_the_fixed_gemms_return_no_view():
    from tpdiag.kernels.grouped_linear import RowLinearPartial, _mm
    from tpdiag.kernels.row_blocks import row_blocked_mm

    x, w = torch.randn(2, 5, 64), torch.randn(48, 64)
    assert row_blocked_mm(x, w.t().contiguous())._base is None
    assert _mm(x, w.t().contiguous())._base is None
    y = RowLinearPartial.apply(x.requires_grad_(), w.requires_grad_(), 2)
    y *= 2.0  # autograd refuses this on a custom Function's view output
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
