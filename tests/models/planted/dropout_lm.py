"""A user's LM with dropout (p=0.1, training mode) between its column- and row-parallel linears:
at TP=2 the mask is drawn per shard, so TP=1 and TP=2 compute different functions."""
import torch, torch.nn.functional as F
from torch import nn
import tpdiag
V, D, B, S = 128, 64, 2, 12

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        h = h + self.down(F.dropout(F.gelu(self.up(h)), 0.1, self.training))
        return self.head(self.norm(h))

def plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}

def inputs(g):
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)}

def target():
    return tpdiag.Target(model=LM(), plan=plan(), inputs=inputs, vocab_size=V)
