"""TP plans as plain tables {fqn pattern: ParallelStyle} (torchtitan style), with named variants."""
from __future__ import annotations

VARIANTS = ("stock", "stable", "sp")
# Plan variants of an `hf:` model (tpdiag.models.hf_plan): `stock` is transformers' own plan;
# `sharded-head` leaves the LM head's logits as each rank's vocab shard (see hf_plan.SHARDED_HEAD).
HF_VARIANTS = ("stock", "sharded-head")


def llama_plan(variant: str = "stock") -> dict:
    """The Llama plan for the built-in model's module names.

    stock : q/k/v, w1/w3 column-parallel; wo, w2 row-parallel (partial sums all-reduced);
            vocab-parallel embedding; LM head column-parallel with vocab-sharded logits.
    stable: NeMo RL's "numerically stable" plan: wo and w2 become column-parallel over their
            output with the input gathered first, so no cross-rank add happens (but the GEMM
            shapes still change with TP).
    sp    : stock plus sequence parallelism (torchtitan's layout): the residual stream and the
            norms are sharded on the sequence, wo/w2 reduce-scatter into it, attention and MLP
            all-gather it. A norm's weight grad is then a sum over token shards reduced across
            ranks (cause `norm-weight-grad`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if variant == "sp":
        return _llama_sp_plan()

    if variant not in VARIANTS:
        from tpdiag.errors import BadInput

        raise BadInput(f"plan variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if variant == "stable":
        def out_proj():
            return ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    else:
        def out_proj():
            return RowwiseParallel()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": out_proj(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": out_proj(),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def _llama_sp_plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                 desired_input_layouts=(Replicate(), None, None),
                                                 use_local_output=True),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),),
                                                    use_local_output=True),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
