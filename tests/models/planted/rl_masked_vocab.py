"""An RL team's policy that never emits its last MASKED token ids (reserved control tokens): its
forward sets their logits to -inf, as a model with reserved or padded vocabulary ids does. The
trainer's loss is the team's (rl_loss_logprob.py); the labels are aligned with the logits, as
tpdiag passes them.

  masked_ok           the correct loss: log_softmax of the float32 logits, gathered.   rounding
  masked_shift_twice  the aligned labels shifted again (`logits[:, :-1]` against
                      `labels[:, 1:]`).                                                 BUG (Target.loss)

    tpdiag rollout FILE --model py:tests/models/planted/rl_masked_vocab.py:masked_shift_twice --mode prefill
"""
import torch

import tpdiag
from rl_loss_logprob import VOCAB, Policy, _loss, plan

MASKED = 4


class MaskedPolicy(Policy):
    def forward(self, input_ids, cache=None):
        logits = super().forward(input_ids, cache)
        return logits.masked_fill(torch.arange(VOCAB, device=logits.device) >= VOCAB - MASKED, float("-inf"))


def masked_ok():
    return tpdiag.Target(model=MaskedPolicy(), plan=plan(), vocab_size=VOCAB, loss=_loss("ok"))


def masked_shift_twice():
    return tpdiag.Target(model=MaskedPolicy(), plan=plan(), vocab_size=VOCAB, loss=_loss("shift_twice"))
