"""A PPO/GRPO trainer's chosen-token logprobs from a vocab-parallel LM head, as an RL team writes
them (helper hplant19): the head is `ColwiseParallel()` (each rank's logits are its vocab shard);
at TP=1 the loss takes `log_softmax(logits / T)`, at TP > 1 the trainer's own vocab-parallel
logprob (Megatron's: the max, the exp-sum and the target logit all-reduced). The loss is PPO's
clipped surrogate, token-mean over the response, its old logprobs the rollout's (here this step's
own, detached, moved by a fixed drift so some ratios clip). Sampling temperature T = 0.7.

  offset_global   the target mask built from the GLOBAL id against the LOCAL vocab size
                  (`labels < per`, the shard start not subtracted): at TP=2 rank 1 picks its local
                  row y - 16 clamped for ids below 16 and never its own ids.            BUG (loss)
  temp_raw_target the temperature on one side only: the log-sum-exp of the tempered shard, the
                  target logit picked from the raw shard.                               BUG (loss)
  temp_twice      the logits divided by T before the trainer's vocab-parallel helper, which
                  divides by T again.                                                   BUG (loss)
  target_sum_bwd  the target logit's all-reduce through torch.distributed.nn.functional's
                  all_reduce (its backward sums the ranks' grads; every rank computes the same
                  loss from it, so each rank's grad of it is the whole grad): the target logit's
                  grad is TP times. The loss is exact.                        BUG (logits' grad)
  logprob_ok      the twin: every reduction with Megatron's identity backward, T once.  rounding
  logprob_ok_mlp  the twin with a Megatron MLP (`ColwiseParallel()` up, `RowwiseParallel()` down)
                  before the norm: its all-reduce moves the logits by rounding.         rounding

    tpdiag compare --model py:tests/models/planted/rl_logprob.py:offset_global --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpdiag

VOCAB, DIM, BATCH, SEQ = 32, 32, 2, 8
TEMP, EPS, DRIFT = 0.7, 0.2, 0.3


def rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Reduce(torch.autograd.Function):
    """All-reduce SUM forward; every rank computes the same loss from it: identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def vocab_parallel_logprobs(z, y, how):
    """log p(y) from this rank's vocab shard z [tokens, V/TP] (already tempered by the caller
    except where `how` says otherwise)."""
    r, _ = rank_world()
    per = z.shape[-1]
    start = r * per
    if how == "temp_raw_target":
        raw, z = z, z / TEMP
    if how == "temp_twice":
        z = z / TEMP  # the helper tempers too
    m = z.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    lse = torch.log(_Reduce.apply(torch.exp(z - m).sum(-1))) + m.squeeze(-1)
    if how == "offset_global":
        mine = (y >= 0) & (y < per)
    else:
        mine = (y >= start) & (y < start + per)
    local = (y - start).clamp(0, per - 1)
    src = raw if how == "temp_raw_target" else z
    t = src.gather(1, local.unsqueeze(1)).squeeze(1) * mine
    if how == "target_sum_bwd":
        from torch.distributed.nn.functional import all_reduce

        t = all_reduce(t)
    else:
        t = _Reduce.apply(t)
    return t - lse


def ppo_loss(logits, labels, how):
    z = logits.flatten(0, -2).float()
    y = labels.flatten()
    keep = y != -100
    y = y.masked_fill(~keep, 0)
    if rank_world()[1] == 1:
        logp = F.log_softmax(z / TEMP, -1).gather(1, y.unsqueeze(1)).squeeze(1)
    else:
        zt = z if how in ("temp_raw_target",) else z / TEMP
        logp = vocab_parallel_logprobs(zt, y, how)
    # the rollout's logprobs: a fixed drift from this policy's (a function of the positions only)
    drift = DRIFT * torch.sin(torch.arange(y.numel(), dtype=torch.float32) * 1.7)
    old_logp = logp.detach() + drift
    ratio = torch.exp(logp - old_logp)
    adv = torch.linspace(-1.0, 1.0, labels.shape[0]).repeat_interleave(labels.shape[1])
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    return -(surr * keep).sum() / keep.sum()


class LM(nn.Module):
    def __init__(self, mlp=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)) if mlp else None
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.mlp is not None:
            h = h + self.mlp(h)
        return self.head(self.norm(h))


def _inputs(g):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    labels[:, :2] = -100  # the prompt
    return {"input_ids": ids, "labels": labels}


def _target(how, mlp=False):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"head": ColwiseParallel()}
    if mlp:
        plan.update({"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
    return tpdiag.Target(model=LM(mlp), plan=plan, vocab_size=VOCAB, inputs=_inputs,
                         loss=lambda logits, labels: ppo_loss(logits, labels, how))


def offset_global():
    return _target("offset_global")


def temp_raw_target():
    return _target("temp_raw_target")


def temp_twice():
    return _target("temp_twice")


def target_sum_bwd():
    return _target("target_sum_bwd")


def logprob_ok():
    return _target("ok")


def logprob_ok_mlp():
    return _target("ok", mlp=True)
