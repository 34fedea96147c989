"""A user's own TP plan for an OLMo2 checkpoint loaded with plain `from_pretrained`. OLMo2's q_norm /
k_norm are RMSNorms over the WHOLE q (k) projection, every head at once: with q column-sharded, a norm
over the rank's columns alone is another function (a real bug); gathered, or run on DTensors that
reduce the mean across ranks, it is the model."""
import os

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, ParallelStyle
from transformers import AutoModelForCausalLM
import tpdiag

DIR = os.environ["USER_OLMO2_DIR"]   # the checkpoint the test saved (save_pretrained)
A, M = "model.layers.*.self_attn.", "model.layers.*.mlp."


class LocalNormShard(ParallelStyle):
    """keep this rank's slice of the norm weight (q is column-sharded, so is its norm)"""
    def _apply(self, module, mesh):
        r, n = mesh.get_local_rank(), mesh.size()
        w = module.weight.detach()
        k = w.shape[0] // n
        module.weight = nn.Parameter(w[r * k:(r + 1) * k].clone())
        return module


class DTensorNorm(ParallelStyle):
    """the norm runs on DTensors: the mean over the sharded columns is reduced by DTensor"""
    def _apply(self, module, mesh):
        module.weight = nn.Parameter(DTensor.from_local(module.weight.detach().clone(), mesh, [Replicate()])
                                     .redistribute(mesh, [Shard(0)]))
        module.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], mesh, [Shard(-1)]),))
        module.register_forward_hook(lambda m, a, o: o.to_local())
        return module


def _base():
    return {A + "q_proj": ColwiseParallel(), A + "k_proj": ColwiseParallel(), A + "v_proj": ColwiseParallel(),
            A + "o_proj": RowwiseParallel(),
            M + "gate_proj": ColwiseParallel(), M + "up_proj": ColwiseParallel(), M + "down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}


def _t(plan):
    model = AutoModelForCausalLM.from_pretrained(DIR)
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.config.vocab_size)


def naive():        # what the llama plan gives: the norms left whole
    return _t(_base())


def shard_norm():   # the norm cut like q: a norm over the rank's columns only - a real bug
    return _t({**_base(), A + "q_norm": LocalNormShard(), A + "k_norm": LocalNormShard()})


def dtensor_norm():  # the norm on DTensors: correct
    return _t({**_base(), A + "q_norm": DTensorNorm(), A + "k_norm": DTensorNorm()})


def gathered():     # q/k/v gathered, the norms see every head: correct
    p = _base()
    for x in "qkv":
        p[A + x + "_proj"] = ColwiseParallel(output_layouts=Replicate())
    p[A + "o_proj"] = RowwiseParallel(input_layouts=Replicate())
    return _t(p)
