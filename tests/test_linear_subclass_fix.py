"""An nn.Linear subclass with a forward of its own under the fixes: PhiMoE's router
(PhimoeTopKRouter) is an nn.Linear whose forward returns (logits, routing weights, experts). The
linear fixes wrapped every Linear the plan leaves whole with a plain linear, so inside grad
accumulation's window (invariant-gemm, any training step) the router returned one tensor and
`compare --fix all` on a PhiMoE checkpoint failed at TP=1 ("too many values to unpack (expected
3)"). Its own forward now runs, and only its F.linear on its own weight goes through the carry:
the router's weight grad is then the same bits whether the batch is one piece or two."""
import torch
import torch.nn.functional as F
from torch import nn

from tpdiag.fixes import linear, state
from tpdiag.kernels import grad_carry


class Router(nn.Linear):
    def forward(self, x):
        logits = super().forward(x)
        w, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
        return logits, w, idx


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router(64, 8, bias=False)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        logits, w, idx = self.router(self.proj(x))
        return logits * w.sum(-1, keepdim=True) + idx.float()[:, :1]


def _grads(model, x, pieces):
    model.zero_grad(set_to_none=True)
    with linear.linear_fix(linear.BLOCKED, model, {}, 1), state.flag(linear.BLOCKED):
        with grad_carry.window():
            for part in x.chunk(pieces):
                out = model(part)
                (out.float() ** 2).sum().backward()
    return model.router.weight.grad.clone(), model.proj.weight.grad.clone()


def test_a_linear_subclass_keeps_its_forward_and_its_grad_is_carried():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(96, 64)
    with linear.linear_fix(linear.BLOCKED, model, {}, 1), state.flag(linear.BLOCKED):
        with grad_carry.window() as w:
            logits, weights, idx = model.router(x)
            # its own forward's result, its logits the plain linear's to rounding
            assert idx.shape == (96, 2) and torch.allclose(logits, F.linear(x, model.router.weight), atol=1e-5)
            assert any(s.name == "router.weight" for s in w.sites.values())
            model.zero_grad(set_to_none=True)
    assert type(model.router).forward is Router.forward and "forward" not in model.router.__dict__
    one, one_p = _grads(model, x, 1)
    three, three_p = _grads(model, x, 3)
    assert torch.equal(one, three) and torch.equal(one_p, three_p)
