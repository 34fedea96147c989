"""A user's file for a checkpoint loaded with plain `from_pretrained`, whose TP plan is the model's
own as transformers gives it: `model.tp_plan`, a dict of style NAMES ("colwise", "rowwise",
"replicated_with_grad_allreduce", ...), not torch ParallelStyles. A Qwen3-style model: per-head
q_norm / k_norm between the column-parallel q/k projections and attention, replicated, their
weight grads each rank's partial (its own heads) until transformers' style all-reduces them."""
import os

from transformers import AutoModelForCausalLM

import tpdiag

DIR = os.environ["USER_HF_PLAN_DIR"]   # the checkpoint the test saved (save_pretrained)


def _t(plan_of):
    model = AutoModelForCausalLM.from_pretrained(DIR)
    return tpdiag.Target(model=model, plan=plan_of(model), vocab_size=model.config.vocab_size)


def tp_plan():        # the model's own plan, as from_pretrained(tp_plan="auto") applies it: correct
    return _t(lambda m: dict(m.tp_plan))


def norms_unreduced():  # the norms left out of the plan: replicated, their grads never all-reduced
    return _t(lambda m: {k: v for k, v in m.tp_plan.items() if not k.endswith(("q_norm", "k_norm"))})


def misspelt():       # a style name transformers does not have
    return _t(lambda m: {**m.tp_plan, "model.layers.*.self_attn.q_proj": "colwsie"})
