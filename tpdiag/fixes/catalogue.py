"""The fixes DESIGN.md names, as {name: Fix}. A fix without an implementation has install=None."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tpdiag.fixes import state
from tpdiag.fixes.layouts import MOE_LAYOUTS


@dataclass(frozen=True)
class Fix:
    name: str
    fixes: tuple[str, ...]  # causes it removes
    ops: tuple[str, ...]    # ops / layouts it replaces
    cost: str
    install: Callable | None = None  # (model, plan, world) -> context manager

    def to_dict(self) -> dict:
        return {"name": self.name, "fixes": list(self.fixes), "ops": list(self.ops),
                "cost": self.cost, "available": self.install is not None}


FIXES: dict[str, Fix] = {}


def register(fix: Fix) -> Fix:
    FIXES[fix.name] = fix
    return fix


def _linear(flag):
    def install(model, plan, world):
        from tpdiag.fixes.linear import linear_fix

        return linear_fix(flag, model, plan, world)

    return install


def _flag(name):
    # The runner reads these flags where it computes the loss / grad norm itself.
    def install(model, plan, world):
        return state.flag(name)

    return install


register(Fix("tp-invariant-linear", ("row-parallel-reduction", "column-parallel-dgrad"),
             ("RowwiseParallel forward", "ColwiseParallel dgrad",
              *(f"MoE experts: {m}" for m in MOE_LAYOUTS)),
             "fp32 partials per fixed K group + one tree all-gather of [tokens, N] per layer "
             "(no weight all-gather)", _linear("tp-invariant-linear")))
register(Fix("invariant-gemm", ("shape-dependent-gemm", "batch-variant-kernel"),
             ("ColwiseParallel forward/wgrad", "linear/bias/embedding weight grads across micro-batches"),
             "column GEMMs whose bits do not depend on the shard or the rows per call: the invariant Triton GEMM (CUDA), fixed N blocks x fixed 16-row blocks of one shape (CPU); "
             "with micro-batches an fp32 carry per weight, walked in fixed token blocks (an fp32 copy of the weights during the step)",
             _linear("invariant-gemm")))
register(Fix("invariant-vocab-softmax", ("vocab-parallel-softmax",),
             ("vocab-parallel log-softmax / cross-entropy",),
             "exp-sums per fixed vocab group, one tree all-gather of [tokens] floats",
             _flag("invariant-vocab-softmax")))
register(Fix("invariant-grad-norm", ("grad-norm",), ("global grad norm + clip",),
             "grads gathered whole, float64 norm; torch's clip coefficient from it",
             _flag("invariant-grad-norm")))
def _norm(model, plan, world):
    from tpdiag.fixes.norm import norm_fix

    return norm_fix(model, plan, world)


register(Fix("invariant-norm-grad", ("norm-weight-grad",),
             ("RMSNorm under SequenceParallel", "replicated RMSNorm weight grads across micro-batches"),
             "weight-grad sums per fixed sequence group, one tree all-gather of [hidden] per norm; "
             "with micro-batches a replicated norm's weight grad into an fp32 carry in fixed token blocks",
             _norm))
def _det(model, plan, world):
    from tpdiag.kernels.det_collectives import deterministic_all_reduce

    return deterministic_all_reduce()


register(Fix("deterministic-collectives", ("collective-nondeterminism",),
             ("_c10d_functional::all_reduce (DTensor Partial -> Replicate)",),
             "all-gather + rank-ordered sum: deterministic at a fixed TP, not TP-invariant", _det))


def _attention(model, plan, world):
    from tpdiag.fixes.attention import attention_fix

    return attention_fix(model, plan, world)


register(Fix("invariant-attention", ("attention-kernel",), ("F.scaled_dot_product_attention",),
             "own attention kernels, fixed tiles, no split-KV, separate dq pass (no atomics): Triton on "
             "CUDA, fwd+bwd ~1.1x cuDNN's at head_dim 64, 1.2x at 128 (H100, H200; docs/benchmarks.md); "
             "elementwise fp32 torch path with fixed key blocks on the CPU or with an explicit mask (slow; a decode query = its causal prefill row)",
             _attention))
