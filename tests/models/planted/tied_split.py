"""A user's tied-embedding LM (head.weight is emb.weight). bug(): the plan shards both the
embedding (vocab-parallel) and the head (column-parallel), so parallelize_module replaces the one
weight twice - two parameters at TP=2, each with only its own module's grad. twin(): the plan
leaves both whole (the tie holds)."""
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
        self.head.weight = self.emb.weight          # tied
    def forward(self, input_ids):
        h = self.emb(input_ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h))

def plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"emb": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(), "down": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}

def inputs(g):
    ids = torch.randint(0, V, (B, S), generator=g)
    return {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)}

def bug():
    return tpdiag.Target(model=LM(), plan=plan(), inputs=inputs, vocab_size=V)


def twin():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(), plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
                         inputs=inputs, vocab_size=V)
