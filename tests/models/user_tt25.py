"""A pretraining team's torchtitan-style Llama (helper hplant25), written as the team writes it:
`Transformer.forward(tokens)`, `tok_embeddings` / `layers.N` / `norm` / `output` (untied), its own
RMSNorm behind a hand-written autograd Function (the team's "fused" kernel, plain tensors in and out),
real-valued RoPE (cos/sin tables, rotate-half), GQA (4 query heads, 2 kv heads), SwiGLU, and
torchtitan's TP plan with sequence parallelism and a loss-parallel head, applied by torch's own
`parallelize_module`. Vocab 32, dim 32, 2 layers, batch 2 x 8.

Each FUNC is the team's trainer with one thing done as the team first wrote it:

  ok              correct: the kernel takes the local shards of a SequenceParallel norm, its weight's
                  grad handed back as a Partial (summed over the ranks' positions).       rounding
  ok_nosp         correct: the plain TP plan (no sequence parallelism), row-parallel outputs
                  all-reduced by DTensor.                                                 rounding
  norm_grad_local the norm's weight passed to the kernel as `weight.to_local()`: its grad comes back
                  as each rank's positions' share, labelled Replicate - never summed.     BUG
  double_reduce   ok_nosp's model with Megatron's `reduce_from_tensor_model_parallel_region` kept
                  on the MLP's output (ported code) - DTensor's RowwiseParallel already reduced it:
                  the MLP's output TP x itself.                                           BUG
  loss_world      the loss divided by `dist.get_world_size()`, as the trainer does for data
                  parallelism: the TP ranks counted as data-parallel replicas.            BUG
  data_rank_seed  the batch drawn by a sampler seeded with the GLOBAL rank (meant for data
                  parallelism): each TP rank trains on other tokens.                      BUG
  label_smooth    `F.cross_entropy(..., label_smoothing=0.1)` on the loss-parallel logits (torch's
                  `loss_parallel` documents label smoothing as not supported).
  data_rank_shard the batch split over the world's ranks, as a DistributedSampler given the global
                  rank and world size splits it: each TP rank trains on its own rows.       BUG
  logit_scale     a learned query temperature (one 0-dim plain parameter) on the column-parallel q:
                  each rank's grad of it is its own heads' share, never summed.          BUG
  wo_bias         correct: the output projection with a bias under RowwiseParallel(output_layouts=
                  Shard(1)) - DTensor adds it once, after the reduce-scatter.            rounding
  zloss_ok        correct: PaLM's z-loss on the gathered logits (`full_tensor()`), the cross-entropy's
                  replicated DTensor gathered too.                                         rounding
  zloss_split     zloss_ok's coefficient divided by the world size - "every TP rank adds the z-loss" -
                  though nothing sums the ranks' losses.                                   BUG
  mlp_local       the MLP left out of the plan under sequence parallelism ("position-wise: it can run
                  on each rank's own positions"): its weights' grads are each rank's positions'
                  share, never summed.                                                     BUG
  head_replicated correct: the head's logits a replicated DTensor (`output_layouts=Replicate(),
                  use_local_output=False`), the loss gathering them with `full_tensor()`. rounding
  zloss           PaLM's z-loss from `torch.logsumexp` of the loss-parallel logits, gathered with
                  `full_tensor()`: its backward mixes DTensor and Tensor at TP > 1 (torch raises).

    tpdiag compare --model py:tests/models/user_tt25.py:norm_grad_local --tp 1,2
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

import tpdiag

DIM, N_LAYERS, N_HEADS, N_KV, VOCAB, HIDDEN, MAX_SEQ = 32, 2, 4, 2, 32, 64, 16
BATCH, SEQ = 2, 8


class _RMSNormFn(torch.autograd.Function):
    """The team's fused RMSNorm: float32 statistics, one pass each way, plain tensors only."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return (xhat * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        xhat, rstd, weight = ctx.saved_tensors
        gy = gy.float()
        gw = (gy * xhat).flatten(0, -2).sum(0)          # over this call's positions only
        gxhat = gy * weight.float()
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx.to(gy.dtype), gw.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, partial_grad=True):
        super().__init__()
        self.eps, self.partial_grad = eps, partial_grad
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if not isinstance(x, DTensor):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        # SequenceParallel hands the norm Shard(1) activations and a Replicate weight; the kernel
        # runs on this rank's positions, so its weight grad is this rank's share of the sum
        w = self.weight.to_local(grad_placements=[Partial()]) if self.partial_grad else self.weight.to_local()
        out = _RMSNormFn.apply(x.to_local(), w, self.eps)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def rope_tables(head_dim, end, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(end).float(), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x, cos, sin):  # x: (bs, seq, heads, head_dim)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def _reduce_from_tp(x):
    """Megatron's reduce_from_tensor_model_parallel_region, kept from the team's Megatron code."""
    return _ReduceFromTP.apply(x) if dist.is_initialized() and dist.get_world_size() > 1 else x


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Attention(nn.Module):
    def __init__(self, logit_scale=False, wo_bias=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = N_HEADS, N_KV, DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=wo_bias)
        self.logit_scale = nn.Parameter(torch.tensor(1.0)) if logit_scale else None

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        if self.logit_scale is not None:  # a learned temperature on the queries (one scalar)
            xq = xq * self.logit_scale
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, cos[:seqlen], sin[:seqlen]), apply_rope(xk, cos[:seqlen], sin[:seqlen])
        n_rep = self.n_heads // self.n_kv_heads
        xk, xv = xk.repeat_interleave(n_rep, dim=2), xv.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, megatron_reduce=False):
        super().__init__()
        self.megatron_reduce = megatron_reduce
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return _reduce_from_tp(out) if self.megatron_reduce else out


class TransformerBlock(nn.Module):
    def __init__(self, partial_grad=True, megatron_reduce=False, **attn):
        super().__init__()
        self.attention_norm = RMSNorm(DIM, partial_grad=partial_grad)
        self.attention = Attention(**attn)
        self.ffn_norm = RMSNorm(DIM, partial_grad=partial_grad)
        self.feed_forward = FeedForward(megatron_reduce)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, partial_grad=True, megatron_reduce=False, **attn):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        cos, sin = rope_tables(DIM // N_HEADS, MAX_SEQ)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(partial_grad, megatron_reduce, **attn)
                                     for i in range(N_LAYERS)})
        self.norm = RMSNorm(DIM, partial_grad=partial_grad)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def tp_plan(sequence_parallel=True):
    """torchtitan's Llama plan; without sequence parallelism the norms stay replicated."""
    if not sequence_parallel:
        layer = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                 "feed_forward.w3": ColwiseParallel()}
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    else:
        layer = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                          use_local_output=False)}
    plan.update({f"layers.*.{k}": v for k, v in layer.items()})
    return plan


def batch(g):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def batch_by_rank(g):
    # the trainer's sampler, seeded per process for data parallelism - by the global rank
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234 + rank))


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)


def cross_entropy_dp_mean(logits, labels):
    # the trainer's data-parallel mean: each replica's loss / world size before grads are summed
    world = dist.get_world_size() if dist.is_initialized() else 1
    return cross_entropy(logits, labels) / world


def cross_entropy_smoothed(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100,
                           label_smoothing=0.1)


def _target(model=None, plan=None, inputs=batch, loss=cross_entropy):
    return tpdiag.Target(model=model or Transformer(), plan=plan or tp_plan(), vocab_size=VOCAB,
                         inputs=inputs, loss=loss)


def ok():
    return _target()


def ok_nosp():
    return _target(plan=tp_plan(sequence_parallel=False))


def norm_grad_local():
    return _target(model=Transformer(partial_grad=False))


def double_reduce():
    return _target(model=Transformer(megatron_reduce=True), plan=tp_plan(sequence_parallel=False))


def loss_world():
    return _target(loss=cross_entropy_dp_mean)


def data_rank_seed():
    return _target(inputs=batch_by_rank)


def label_smooth():
    return _target(loss=cross_entropy_smoothed)


def batch_rank_shard(g):
    # the trainer's DistributedSampler over the world - the TP ranks taken for data-parallel ones
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    whole = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return whole[rank * BATCH // world:(rank + 1) * BATCH // world]


def data_rank_shard():
    return _target(inputs=batch_rank_shard)


def cross_entropy_zloss(logits, labels):
    # PaLM's z-loss on the loss-parallel logits, as DTensor computes a logsumexp over the vocab shards
    z = torch.logsumexp(logits.float(), dim=-1)
    if isinstance(z, DTensor):
        z = z.full_tensor()
    keep = (labels != -100).flatten()
    return cross_entropy(logits, labels) + 1e-4 * (z.flatten()[keep] ** 2).mean()


def zloss():
    return _target(loss=cross_entropy_zloss)


def logit_scale():
    return _target(model=Transformer(logit_scale=True))


def wo_bias():
    return _target(model=Transformer(wo_bias=True))


def _zloss_whole(logits, labels, coef):
    # the z-loss on the whole logits, gathered first (a plain tensor: no DTensor op in its backward)
    whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
    z = torch.logsumexp(whole.float(), dim=-1).flatten()[(labels != -100).flatten()]
    ce = cross_entropy(logits, labels)
    if isinstance(ce, DTensor):  # loss_parallel's loss is a replicated DTensor; z a plain tensor
        ce = ce.full_tensor()
    return ce + coef * (z ** 2).mean()


def cross_entropy_zloss_whole(logits, labels):
    return _zloss_whole(logits, labels, 1e-4)


def cross_entropy_zloss_per_rank(logits, labels):
    # "every TP rank adds the z-loss, so each adds its 1/TP share" - but nothing sums the ranks' losses
    world = dist.get_world_size() if dist.is_initialized() else 1
    return _zloss_whole(logits, labels, 1e-4 / world)


def zloss_ok():
    return _target(loss=cross_entropy_zloss_whole)


def zloss_split():
    return _target(loss=cross_entropy_zloss_per_rank)


def _plan_without_mlp():
    # "the MLP is position-wise: under sequence parallelism it can run on each rank's own positions"
    plan = {k: v for k, v in tp_plan().items() if ".feed_forward" not in k}
    plan["layers.*.ffn_norm"] = SequenceParallel(use_local_output=True)
    return plan


def mlp_local():
    return _target(plan=_plan_without_mlp())


def cross_entropy_gathered(logits, labels):
    # the head's output is a replicated DTensor: every rank holds every logit
    return cross_entropy(logits.full_tensor() if isinstance(logits, DTensor) else logits, labels)


def head_replicated():
    plan = tp_plan()
    plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False)
    return _target(plan=plan, loss=cross_entropy_gathered)
