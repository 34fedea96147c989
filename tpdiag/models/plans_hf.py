"""TP plans tpdiag carries for `hf:` architectures whose transformers plan is missing or wrong.

A plain table {model_type: {fqn pattern: style name}} in transformers' own plan format (the
`base_model_tp_plan` of a config class). `resolve` puts a table plan on a loaded config when:
- transformers has none for the model type (an empty plan, or one that splits only the embedding
  - gpt_oss in transformers 5.24), or
- transformers' plan holds an entry known to be wrong (KNOWN_BROKEN: doge's dt_proj), so a
  transformers release that fixes its plan is used as it is, or
- transformers' plan leaves out modules a config option adds (EXTRA: cohere's use_qk_norm per-head
  norms): its plan plus the missing entries.
The user's own plan always wins: a `base_model_tp_plan` written in the checkpoint's config.json
(read by transformers as a config attribute) is never replaced (docs/models.md).

Styles are transformers' registered names, plus tpdiag's own (tpdiag.models.hf_plan.OWN_STYLES)
for two layouts transformers has no name for: `colwise_gather_input` and `replicated_once`.
"""
from __future__ import annotations

import json
import os

# gpt_oss (shards as vLLM/SGLang do; checked on tiny checkpoints at TP=1,2,4 in
# tests/test_hf_plans.py):
# - attention: q/k/v column-parallel by heads (their biases too), o_proj row-parallel (its bias
#   added once after the all-reduce). The attention sinks are one scalar per query head: cut
#   like the heads (`colwise` on a 1-D parameter is Shard(0)), and `local_params` runs the
#   attention module on its local sinks. Sliding-window layers only change the mask (positions,
#   not heads): nothing more to shard.
# - experts (`moe_tp_experts`: each rank holds a slice of every expert's intermediate dim I; the
#   partial outputs are all-reduced). gate_up_proj [E, H, 2I] INTERLEAVES gate and up on its last
#   dim (gate = [..., ::2], up = [..., 1::2]): a contiguous Shard(-1) (`rowwise` on a weight not
#   named 'bias') keeps each (gate, up) pair on one rank; `packed_rowwise` (a [gate | up] split)
#   would pair the wrong columns. gate_up_proj_bias [E, 2I] is cut the same way. down_proj
#   [E, I, H] is cut on I (`colwise`: Shard(1)). down_proj_bias [E, H] is added inside each
#   expert before the sum over ranks: replicated it would count TP times; `replicated_once` adds
#   it on rank 0 only (vLLM zeroes it on the other ranks).
# - the router stays replicated (its top-k must be the same on every rank).
GPT_OSS = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn": "local_params",
    "layers.*.self_attn.sinks": "colwise",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.experts.gate_up_proj": "rowwise",
    "layers.*.mlp.experts.gate_up_proj_bias": "rowwise",
    "layers.*.mlp.experts.down_proj": "colwise",
    "layers.*.mlp.experts.down_proj_bias": "replicated_once",
}

# doge: transformers' plan with dt_proj fixed. dt_proj maps ALL kv heads' values to one
# dynamic-mask value per kv head (a dense [kv, kv*head_dim] weight), and the mask must come
# out for the rank's local kv heads only. transformers' `rowwise` returns all kv heads (the SDPA
# shape error of the zoo row); here its input (the local heads' values) is all-gathered and its
# output columns cut like the heads (`colwise_gather_input`), and the per-kv-head A is cut like
# the heads under `local_params` on the attention module. q_norm/k_norm (one weight over head_dim,
# applied to the rank's local heads) get each rank's partial weight grad: all-reduced, as in
# transformers' own qwen3 plan (without it the replicas part after one step: a
# rank-inconsistent-replica).
DOGE = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.dt_proj": "colwise_gather_input",
    "layers.*.self_attn": "local_params",
    "layers.*.self_attn.A": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "layers.*.mlp.router_gate": "colwise_gather_output",
    "layers.*.mlp.down_embed": "embedding_rowwise",
    "layers.*.mlp.up_embed": "embedding_rowwise",
}

PLANS: dict[str, dict[str, str]] = {"gpt_oss": GPT_OSS, "doge": DOGE}

# cohere with use_qk_norm (Command R+): q_norm/k_norm are LayerNorms whose weight is one row per
# head, [heads, head_dim] and [kv_heads, head_dim], applied to the rank's local heads after the
# column-parallel q/k projections. transformers' plan leaves them replicated, so at TP=2 the norm
# multiplies [.., heads/2, head_dim] by [heads, head_dim] ("The size of tensor a (4) must match the
# size of tensor b (2)", the degree fails). Cut like the heads (`colwise` on [rows, head_dim] is
# Shard(0)) and run on the local rows (`local_params`); each rank's rows then get exactly their
# own heads' grad, so no all-reduce is needed (unlike qwen3's one shared head_dim weight).
COHERE_QK_NORM = {
    "layers.*.self_attn.q_norm": "local_params",
    "layers.*.self_attn.q_norm.weight": "colwise",
    "layers.*.self_attn.k_norm": "local_params",
    "layers.*.self_attn.k_norm.weight": "colwise",
}

# {model_type: (config predicate, entries)}: entries added to transformers' plan for a config
# option the plan does not shard; added only where transformers' plan has no entry of that name
# (a release that shards them is used as it is).
EXTRA: dict = {"cohere": (lambda c: bool(getattr(c, "use_qk_norm", False)), COHERE_QK_NORM)}

# {model_type: {(pattern, style)}}: entries of transformers' plan known to be wrong; a plan that
# holds one is replaced by the table's.
KNOWN_BROKEN: dict[str, set] = {"doge": {("layers.*.self_attn.dt_proj", "rowwise")}}


def splits_nothing(plan: dict | None) -> bool:
    """True for a plan that shards no layer: none, or the embedding only (at most the LM head's
    own entry is added by the model class)."""
    return not [k for k in (plan or {}) if "embed" not in k]


def table_plan(model_type: str, plan: dict | None, config=None) -> dict | None:
    """The table's plan for `model_type` (whose text config is `config`) when transformers' `plan`
    needs it, else None."""
    extra = EXTRA.get(model_type)
    if extra is not None and plan and config is not None and extra[0](config) \
            and not set(extra[1]) & set(plan):
        return {**plan, **extra[1]}
    ours = PLANS.get(model_type)
    if ours is None:
        return None
    broken = KNOWN_BROKEN.get(model_type, set())
    if splits_nothing(plan) or any(plan.get(k) == s for k, s in broken):
        return dict(ours)
    return None


def user_plan(path: str) -> bool:
    """Whether the checkpoint's config.json (or its text part) carries its own base_model_tp_plan."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    parts = [raw] + [v for v in raw.values() if isinstance(v, dict)]
    return any(isinstance(p, dict) and p.get("base_model_tp_plan") for p in parts)


def resolve(config, path: str) -> str:
    """Put the table's plan on `config`'s text part where transformers' is missing or known broken
    (never over the user's own config.json plan). Returns 'tpdiag', 'user' or 'transformers': whose
    plan the model will carry."""
    if user_plan(path):
        return "user"
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    ours = table_plan(str(getattr(tc, "model_type", "") or getattr(config, "model_type", "")),
                      getattr(tc, "base_model_tp_plan", None), tc)
    if ours is None:
        return "transformers"
    tc.base_model_tp_plan = ours
    return "tpdiag"
