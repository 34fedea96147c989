"""Names of the ops that records carry (the op probe's `op` field), by family: the diff engine
reads them to name a cause, the fixes to pick the one that removes it."""
from __future__ import annotations

# the fused scaled-dot-product attention kernels (aten's SDPA backends), whose backward sums dq
# with atomics; FlexAttention's is deterministic
SDPA_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
ATTENTION_OPS = SDPA_OPS + ("flex_attention",)
# substrings of a collective's op name (c10d's and the functional ones)
COLLECTIVE_OPS = ("c10d", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# substrings of ops that draw random numbers (dropout's mask among them): their draws depend on the
# shapes and order in which each layout consumes the generator
RANDOM_OPS = ("bernoulli", "dropout", "::rand", "::normal", "uniform", "multinomial", "randperm",
              "exponential", "geometric", "cauchy", "log_normal")

# picks of elements (exact op names): they compute no number, so from an equal source and equal
# indices they give equal bits
PICK_OPS = ("aten::slice", "aten::select", "aten::index", "aten::index_select")


def is_op_of(op: str | None, family: tuple[str, ...]) -> bool:
    return bool(op) and any(a in op for a in family)
