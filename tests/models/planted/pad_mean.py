"""A loss that counts the padding in its mean - the gradient-accumulation mistake transformers'
trainers shipped until late 2024 - on an SFT/RL batch of responses of different lengths, right-padded
(helper hplant18). The model is a small LM with a DTensor-planned MLP (up `ColwiseParallel()`, down
`RowwiseParallel()`). Labels are -100 on each prompt and on the padding after each response.
Vocab 32, dim 32, ffn 64; batch 4 of 8 tokens.

  pad_counted  `cross_entropy(..., reduction="sum") / labels.numel()`: a mean over every position,
               padding included. At one micro-batch size it is a fixed scale of the token mean;
               accumulated over micro-batches weighted by their tokens (loss_mean="token") it is
               another function at each size.                            BUG (--micro-batch 4,1)
  token_mean   divided by the number of real tokens (labels != -100).    rounding / bitwise

    tpdiag compare --model py:tests/models/planted/pad_mean.py:pad_counted --tp 1,2 \
        --micro-batch 4,1 --batch-size 4 --seq-len 8
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, FFN = 32, 32, 64
PROMPT = (1, 3, 2, 2)   # each row's prompt length
RESPONSE = (6, 2, 4, 1)  # each row's response length; the rest of its 8 positions is padding
PAD = 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return self.head(self.norm(x + self.mlp(x)))


def batch(g):
    ids = torch.randint(1, VOCAB, (len(PROMPT), 8), generator=g)
    labels = torch.full_like(ids, -100)
    for i, (p, n) in enumerate(zip(PROMPT, RESPONSE)):
        ids[i, p + n:] = PAD
        labels[i, p - 1:p + n - 1] = ids[i, p:p + n]
    return {"input_ids": ids, "labels": labels}


def _loss(pad_counted):
    def loss(logits, labels):
        total = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100,
                                reduction="sum")
        return total / (labels.numel() if pad_counted else (labels != -100).sum())
    return loss


def _target(pad_counted):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return tpdiag.Target(model=LM(), plan={"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()},
                         vocab_size=VOCAB, inputs=batch, loss=_loss(pad_counted))


def pad_counted():
    return _target(True)


def token_mean():
    return _target(False)
