"""A user's own TP plans for Hugging Face MoE checkpoints (qwen2_moe, mixtral, granitemoe) loaded with
plain `from_pretrained`. transformers 5 keeps each layer's experts as two 3D parameters
(`gate_up_proj` [E, 2I, H] with gate and up stacked, `down_proj` [E, H, I]) and indexes them per
expert in `forward`, so a user who wants the experts tensor-parallel writes a style that keeps each
rank's slice of every expert as a plain tensor, Megatron-style (identity forward / all-reduce
backward on the input, all-reduce forward on the output).

- `attn_only`: attention TP'd, experts (and router) replicated - correct.
- `experts_tp`: attention TP'd, every expert's intermediate dim cut: gate rows r and up rows r kept
  together - correct (qwen2_moe's shared expert column/row-parallel with it).
- `packed_naive`: the stacked [gate; up] rows cut contiguously: rank 0 keeps every gate row, rank 1
  every up row - `chunk(2)` then pairs gate halves with gate halves: a bug.
- `router_partial`: the router row-parallel on its rank's hidden columns with no reduction: each
  rank routes on partial logits - a bug.
- `shared_gate_partial` (qwen2_moe): the shared expert's sigmoid gate computed from the rank's hidden
  columns with no reduction: sigmoid of a partial logit - a bug.
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import AutoModelForCausalLM
import tpdiag

DIR = os.environ["USER_MOE_DIR"]   # the checkpoint the test saved (save_pretrained)
A = "model.layers.*.self_attn."


class _Reduce(torch.autograd.Function):   # sum of the ranks' partial outputs; grad passes through
    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):     # replicated input; each rank's grad is partial: summed
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class ExpertShard(ParallelStyle):
    """each expert's intermediate dim cut across ranks; `packed=False` cuts the stacked [gate; up]
    rows as one block (the naive way)"""
    def __init__(self, packed=True):
        super().__init__()
        self.packed = packed

    def _apply(self, module, mesh):
        r, n = mesh.get_local_rank(), mesh.size()
        gu, down = module.gate_up_proj.detach(), module.down_proj.detach()
        i = down.shape[-1]
        k = i // n
        if self.packed:
            gu = torch.cat([gu[:, r * k:(r + 1) * k], gu[:, i + r * k:i + (r + 1) * k]], dim=1)
        else:
            gu = gu[:, 2 * r * k:2 * (r + 1) * k]
        module.gate_up_proj = nn.Parameter(gu.clone())
        module.down_proj = nn.Parameter(down[:, :, r * k:(r + 1) * k].clone())
        module.intermediate_dim = k
        # the routing weights scale each rank's partial expert outputs: their grads are partial too
        module.register_forward_pre_hook(lambda m, a: (_Copy.apply(a[0]), a[1], _Copy.apply(a[2])))
        module.register_forward_hook(lambda m, a, o: _Reduce.apply(o))
        return module


class PartialRowwise(ParallelStyle):
    """a [out, H] projection on the rank's own hidden columns, its partial output used as it is"""
    def _apply(self, module, mesh):
        r, n = mesh.get_local_rank(), mesh.size()
        w = module.weight.detach()
        k = w.shape[1] // n
        module.weight = nn.Parameter(w[:, r * k:(r + 1) * k].clone())
        if hasattr(module, "hidden_dim"):
            module.hidden_dim = k
        module.register_forward_pre_hook(
            lambda m, a: (a[0].reshape(-1, a[0].shape[-1])[:, r * k:(r + 1) * k],) + tuple(a[1:]))
        return module


def _names(model):
    kind = model.config.model_type
    moe = "model.layers.*." + ("block_sparse_moe." if kind == "granitemoe" else "mlp.")
    return kind, moe, moe + ("router" if kind == "granitemoe" else "gate")


def _attn():
    return {A + "q_proj": ColwiseParallel(), A + "k_proj": ColwiseParallel(), A + "v_proj": ColwiseParallel(),
            A + "o_proj": RowwiseParallel()}


def _experts(model, packed=True):
    kind, moe, _ = _names(model)
    plan = {**_attn(), moe + "experts": ExpertShard(packed)}
    if kind == "qwen2_moe":
        s = moe + "shared_expert."
        plan.update({s + "gate_proj": ColwiseParallel(), s + "up_proj": ColwiseParallel(),
                     s + "down_proj": RowwiseParallel()})
    return plan


def _t(make):
    model = AutoModelForCausalLM.from_pretrained(DIR)
    return tpdiag.Target(model=model, plan=make(model), vocab_size=model.config.vocab_size)


def attn_only():
    return _t(lambda m: _attn())


def experts_tp():
    return _t(_experts)


def packed_naive():
    return _t(lambda m: _experts(m, packed=False))


def router_partial():
    return _t(lambda m: {**_attn(), _names(m)[2]: PartialRowwise()})


def shared_gate_partial():
    return _t(lambda m: {**_experts(m), _names(m)[1] + "shared_expert_gate": PartialRowwise()})
