"""A user's row-parallel MLP written by hand that keeps only its own shard of each weight as a
Parameter (rank r: `up` rows and `down` columns [r FF/n, (r+1) FF/n), cut from the same full
draw as TP=1's). Each rank's parameters are other bits of one shape - as an expert-parallel
model's experts are - but here they are shards of the reference's weights: the gather rebuilds them
as before (runner/per_rank.py leaves a weight smaller than the reference's to it), and the step's
grad norm sums the shards' squares over the ranks (over one rank's shard it was a false
rank-inconsistent-replica BUG at `optimizer: grad_norm total`).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import tpdiag
V, D, FF = 64, 32, 64
def world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        t = t.clone(); dist.all_reduce(t); return t
    @staticmethod
    def backward(ctx, g):
        return g
class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        g = g.contiguous(); dist.all_reduce(g); return g
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        r, n = world()
        up, down = torch.randn(FF, D) / D ** 0.5, torch.randn(D, FF) / FF ** 0.5
        k = FF // n
        self.up = nn.Parameter(up[r * k:(r + 1) * k].clone())
        self.down = nn.Parameter(down[:, r * k:(r + 1) * k].clone())
    def forward(self, x):
        n = world()[1]
        h = F.gelu((_Copy.apply(x) if n > 1 else x) @ self.up.t()) @ self.down.t()
        return x + (_Reduce.apply(h) if n > 1 else h)
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D); self.block = nn.Sequential(MLP()); self.head = nn.Linear(D, V, bias=False)
    def forward(self, t):
        return self.head(self.block(self.embed(t)))
def target():
    return tpdiag.Target(model=LM(), plan={}, vocab_size=V)
