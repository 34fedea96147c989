"""Layout lookups shared by the fixes (no torch import): which plan style a module has, and the
MoE experts layouts tp-invariant-linear covers (fixes/moe.py; `tpdiag fixes` lists them)."""
from __future__ import annotations

import fnmatch

# The MoE experts layouts tp-invariant-linear covers (fixes/moe.py); any other layout of a
# transformers `moe_tp_experts` module is refused in one line naming it.
MOE_LAYOUTS = (
    "moe_tp_experts with gate_up_proj [E, 2I, H] packed_colwise + down_proj [E, H, I] rowwise "
    "(qwen3_moe, mixtral, deepseek_v3)",
    "moe_tp_experts with gate_up_proj [E, H, 2I] rowwise (interleaved gate/up) + gate_up_proj_bias "
    "rowwise + down_proj [E, I, H] colwise + replicated down_proj_bias (gpt_oss)",
)


def style_obj(name: str, plan: dict):
    for pattern, style in (plan or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None
