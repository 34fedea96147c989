"""An RL team's trainer for a GLM-4 policy, loaded with plain `from_pretrained` from the checkpoint
their rollout engine (transformers' generate()) samples from, under their own TP plan.

GLM-4's MLP holds gate and up in ONE Linear (`gate_up_proj`, out = [gate | up]) and splits its
output with `chunk(2, -1)`. Cutting that Linear column-wise like Llama's `gate_proj` gives rank 0
the gate half and rank 1 the up half; each rank's `chunk` then splits its own shard, so rank 0
multiplies gate columns by gate columns - another function, a real bug that exists only at TP > 1.
transformers' own plan gathers the fused output first (`colwise_gather_output`) and splits the
down projection's input (`rowwise_split_input`): the model."""
import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoModelForCausalLM
import tpdiag

DIR = os.environ["USER_GLM4_DIR"]   # the checkpoint the engine sampled from (save_pretrained)
A, M = "model.layers.*.self_attn.", "model.layers.*.mlp."


def policy_loss(logits, labels):
    """the trainer's token-mean of the sampled tokens' negative float32 logprobs (a GRPO-style
    loss with unit advantages); logits are whole (the head gathers them)"""
    lp = F.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    mask = labels != -100
    return -(lp * mask).sum() / mask.sum()


def _attn():
    return {A + "q_proj": ColwiseParallel(), A + "k_proj": ColwiseParallel(), A + "v_proj": ColwiseParallel(),
            A + "o_proj": RowwiseParallel(), "lm_head": ColwiseParallel(output_layouts=Replicate())}


def _t(plan):
    model = AutoModelForCausalLM.from_pretrained(DIR)
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.config.vocab_size, loss=policy_loss)


def fused_colwise():     # the Llama plan copied onto the fused gate_up_proj: a bug at TP > 1
    return _t({**_attn(), M + "gate_up_proj": ColwiseParallel(), M + "down_proj": RowwiseParallel()})


def fused_gathered():    # transformers' own plan for GLM-4's MLP: correct
    return _t({**_attn(), M + "gate_up_proj": ColwiseParallel(output_layouts=Replicate()),
               M + "down_proj": RowwiseParallel(input_layouts=Replicate())})
