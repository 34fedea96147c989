"""The reordering a record's place in the model names (diff/judge.py reads it once the
non-finite, rank and bound rules have passed): its phase, kind, the TP style of its module and of
the modules that consumed it."""
from __future__ import annotations

from tpdiag.records.ops import ATTENTION_OPS, COLLECTIVE_OPS, is_op_of

NORM_CLASSES = ("RMSNorm", "LayerNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm",
                "MistralRMSNorm", "GemmaRMSNorm")
EMBED_CLASSES = ("Embedding", "VocabParallelEmbedding")


def op_kind(op: str) -> str:
    from tpdiag.diff.generic_bound import GEMM_OPS

    if is_op_of(op, ATTENTION_OPS):
        return "attention-kernel"
    if op.split("::")[-1] in GEMM_OPS:
        return "shape-dependent-gemm"
    if any(c in op for c in COLLECTIVE_OPS):
        return "row-parallel-reduction"
    return "shape-dependent-kernel"


def layout_cause(row: dict) -> str | None:
    """The reordering a record's phase, kind and TP style name when its bits differ within
    rounding (None: the layout names none). Read only after the non-finite, rank and bound rules."""
    phase, kind, style, cls = row["phase"], row["kind"], row.get("style"), row.get("cls")
    if phase == "init":
        return "sharding-bug"  # weights or batch differ before anything ran
    if phase == "forward":
        if kind != "out":
            return None
        if style == "rowwise":
            return "sharding-bug" if cls in EMBED_CLASSES else "row-parallel-reduction"
        if style in ("colwise", "colwise-gathered"):
            return "shape-dependent-gemm"
        if cls in EMBED_CLASSES:
            return "sharding-bug"
        if style == "moeexpertsparallel":
            # transformers' moe_tp_experts: each rank ran its slice of every expert (down_proj
            # cut on its input dim) and the partial outputs are all-reduced
            return "row-parallel-reduction"
        return row.get("generic_cause")
    if phase == "loss":
        return "vocab-parallel-softmax" if kind in ("logprobs", "loss") else None
    if phase == "backward":
        if kind == "grad_out":
            styles = row.get("consumer_styles") or []
            if any(s in ("colwise", "colwise-gathered") for s in styles):
                return "column-parallel-dgrad"
            if any(s == "rowwise" for s in styles):
                return "shape-dependent-gemm"
            if not row.get("consumers") and (style in ("colwise", "colwise-gathered") or _plain_last_shard(row)):
                # a column-parallel output no module consumed: the vocab-sharded logits, whose
                # grad comes from the vocab-parallel loss backward (a plain shard: Megatron's
                # ColumnParallelLinear head written by hand, parallel_output=True)
                return "vocab-parallel-softmax"
            return row.get("generic_cause")
        if kind == "param_grad":
            if cls in NORM_CLASSES or (cls or "").endswith(("RMSNorm", "LayerNorm")):
                # model-specific norm classes (Qwen3MoeRMSNorm, DeepseekV3RMSNorm, ...)
                return "norm-weight-grad"
            if style in ("colwise", "rowwise", "colwise-gathered"):
                return "shape-dependent-gemm"
            return row.get("generic_cause")
        return None
    if phase == "optimizer":
        return "grad-norm" if kind == "grad_norm" else None
    return None


def _plain_last_shard(row: dict) -> bool:
    """A record of plain tensors that the diff gathered along their last dim (no plan style: the
    layout came from the shapes, records/layout.py)."""
    shape = row.get("shape") or []
    return row.get("style") is None and bool(shape) and row.get("layout") == f"shard:{len(shape) - 1}"
