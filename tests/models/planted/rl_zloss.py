"""An RL team's trainer whose loss adds a z-loss to the token-mean cross-entropy, as PaLM and OLMo
train: 1e-4 * logsumexp(logits)**2, averaged over the tokens the labels keep. The policy is the
team's (rl_loss_logprob.py: its own KV cache for the rollout); the labels are aligned with the
logits (labels[t] is the token logits[t] predicts; -100 ignored), as tpdiag passes them.

  zloss_ok           cross-entropy + z-loss: the logprobs are the tokens' log-softmax; the z-loss
                     does not depend on which token is labelled.                  rounding
  entropy_ok         cross-entropy minus an entropy bonus (0.01 * the mean entropy of every
                     position's distribution, labelled or not).                   rounding
  zloss_shift_twice  zloss_ok with the aligned labels shifted again, as a Hugging Face loss does
                     (`logits[:, :-1]` against `labels[:, 1:]`).                  BUG (Target.loss)

    tpdiag rollout FILE --model py:tests/models/planted/rl_zloss.py:zloss_ok --mode prefill
"""
import torch
import torch.nn.functional as F

import tpdiag
from rl_loss_logprob import VOCAB, Policy, plan

Z_WEIGHT = 1e-4
ENTROPY_WEIGHT = 0.01


def zloss(shift=False):
    def loss(logits, labels):
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        keep = labels != -100
        z = torch.logsumexp(logits, -1)
        return ce + Z_WEIGHT * (z.square() * keep).sum() / keep.sum()
    return loss


def entropy_bonus(logits, labels):
    logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    lsm = logits.log_softmax(-1)
    entropy = -(lsm.exp() * lsm).sum(-1).mean()
    return ce - ENTROPY_WEIGHT * entropy


def zloss_ok():
    return tpdiag.Target(model=Policy(), plan=plan(), vocab_size=VOCAB, loss=zloss())


def entropy_ok():
    return tpdiag.Target(model=Policy(), plan=plan(), vocab_size=VOCAB, loss=entropy_bonus)


def zloss_shift_twice():
    return tpdiag.Target(model=Policy(), plan=plan(), vocab_size=VOCAB, loss=zloss(shift=True))
