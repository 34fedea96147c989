"""An RL team's policy whose trainer takes the tokens' logprobs in its own `Target.loss`: a small
causal LM with its own KV cache for the rollout (`new_kv_cache()`, `forward(ids, cache=...)`) and a
token-mean NLL built on the team's `token_logprobs(logits, labels)` - the function its trainer also
takes the policy ratio's numerator from. The labels are aligned with the logits (labels[t] is the
token logits[t] predicts; -100 ignored), as tpdiag passes them.

  shift_twice   token_logprobs shifts again, as a Hugging Face loss does on unshifted labels
                (`logits[:, :-1]` against `labels[:, 1:]`): each row scores the token after its
                own.                                                               BUG (Target.loss)
  softmax_dim   log_softmax over dim 1 - the sequence - instead of the vocabulary.  BUG (Target.loss)
  temp_scaled   the logits divided by the sampling temperature 0.7 of a config the engine no longer
                uses: the engine samples and reports at T = 1.                      BUG (Target.loss)
  lse_temp      the temperature 0.7 put in the logsumexp alone (`z[label] - logsumexp(z / 0.7)`): the
                normaliser is off by a constant per row, so the offset moves with no label, as a
                z-loss's does; the Target says of no such term.                   BUG (Target.loss)
  logprob_ok    the twin: log_softmax of the float32 logits over the vocabulary, gathered. rounding
  logprob_ok_bf16  the twin in bf16: the model and its log_softmax in bf16 (TRL's row loop for
                bf16 logits), rounded to 8 bits before the upcast.                   rounding

    tpdiag rollout FILE --model py:tests/models/planted/rl_loss_logprob.py:shift_twice --mode prefill,decode
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tpdiag

VOCAB, DIM, HEADS, FFN, MAX_LEN = 48, 32, 4, 64, 40
TEMP = 0.7


class Cache:
    def __init__(self):
        self.k = self.v = None

    @property
    def length(self):
        return 0 if self.k is None else self.k.shape[2]


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.norm1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def new_kv_cache(self):
        return Cache()

    def forward(self, input_ids, cache=None):
        B, S = input_ids.shape
        past = 0 if cache is None else cache.length
        x = self.embed(input_ids) + self.pos(torch.arange(past, past + S, device=input_ids.device))
        hd = DIM // HEADS
        h = self.norm1(x)
        q, k, v = (p(h).view(B, S, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        if cache is not None:
            if cache.k is not None:
                k, v = torch.cat([cache.k, k], 2), torch.cat([cache.v, v], 2)
            cache.k, cache.v = k, v
        if past == 0:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the new queries see every cached key and the new keys up to their own position
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(S, past + S, dtype=torch.bool).tril(past))
        x = x + self.o(a.transpose(1, 2).reshape(B, S, -1))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(self.norm(x))


def plan():
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()}


def token_logprobs(logits, labels, how="ok"):
    """log p(label) per position, 0 where the label is ignored (the team's function: the loss and
    the policy ratio both take it)."""
    if how == "shift_twice":
        logits, labels = logits[:, :-1], labels[:, 1:]
    x = logits if how == "bf16" else logits.float()
    if how == "temp_scaled":
        x = x / TEMP
    lsm = x.log_softmax(1 if how == "softmax_dim" else -1)
    if how == "lse_temp":
        lsm = x - torch.logsumexp(x / TEMP, -1, keepdim=True)
    lp = lsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0].float()
    return lp * (labels != -100)


def _loss(how):
    def loss(logits, labels):
        lp = token_logprobs(logits, labels, how)
        n = (labels[:, 1:] if how == "shift_twice" else labels) != -100
        return -lp.sum() / n.sum()
    return loss


def _target(how, dtype=torch.float32):
    return tpdiag.Target(model=Policy().to(dtype), plan=plan(), vocab_size=VOCAB, loss=_loss(how))


def shift_twice():
    return _target("shift_twice")


def softmax_dim():
    return _target("softmax_dim")


def temp_scaled():
    return _target("temp_scaled")


def lse_temp():
    return _target("lse_temp")


def logprob_ok():
    return _target("ok")


def logprob_ok_bf16():
    return _target("bf16", torch.bfloat16)
