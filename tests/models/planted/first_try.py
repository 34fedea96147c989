"""A new user's first py: targets (helper hnew14): a small torchtitan-shaped LM named wrong the way a
first try does - `py:first_try.py:TinyLM` (the model class, not a function returning a Target), FUNC
returning the model itself instead of a tpdiag.Target, and a Target whose vocab_size is the
tokenizer's (1000) while the embedding was built for 128 tokens."""
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM = 128, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.w1 = nn.Linear(DIM, 64, bias=False)
        self.w2 = nn.Linear(64, DIM, bias=False)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        h = h + self.w2(F.silu(self.w1(h)))
        return self.output(h)


def plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def just_the_model():
    return TinyLM()


def tokenizer_vocab():
    return tpdiag.Target(model=TinyLM(), plan=plan(), vocab_size=1000)


def target():
    return tpdiag.Target(model=TinyLM(), plan=plan(), vocab_size=VOCAB)
