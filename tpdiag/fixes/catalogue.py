"""The fixes DESIGN.md names, as {name: Fix}. A fix without an implementation has install=None.

Each entry carries the properties the rest of tpdiag acts on (fixes/registry.py answers the
questions from them): code outside a fix never tests a fix by its name, so a new fix is one
entry here and runs with the right tree groups, fp32 carry and runner switches without any list
to update elsewhere."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tpdiag.fixes.layouts import MOE_LAYOUTS

# How a fix goes in: it wraps the forward of the model's modules; it overrides an op for the
# whole process (torch.library / a torch function mode); or it only switches what the code that
# computes the loss / grad norm itself (runner, tpdiag.clip_grad_norm_) runs.
INSTALLS = ("module-forwards", "op-override", "runner-switch")
# What a fix takes over outside its own modules, read where that is computed (fixes/state.py):
# the loss and token logprobs, the global grad norm + clip, and the all-reduce of a per-head
# norm's weight grad that transformers' plan registers (models/hf_plan.py).
TAKES_OVER = ("loss", "grad-norm", "head-norm-grad-reduce")


@dataclass(frozen=True)
class Fix:
    name: str
    fixes: tuple[str, ...]  # causes it removes
    ops: tuple[str, ...]    # ops / layouts it replaces
    cost: str
    install: Callable | None = None  # (model, plan, world) -> context manager
    installs: str = "module-forwards"  # one of INSTALLS
    grouped: bool = False  # its reductions are cut into the run's tree groups G (fixes/groups.py)
    # > 0: its kernels compute a row the same whatever rows share the call, so it is one of the
    # fixes that confirm a batch-variant kernel; the number is its place in that set (the confirm
    # directory's name joins them in this order)
    batch_invariant: int = 0
    carries_grads: bool = False  # its weight-grad Functions feed grad accumulation's fp32 carry
    takes_over: tuple[str, ...] = ()  # of TAKES_OVER
    # (no arguments) -> context manager: what it adds in a user's own loop (tpdiag.invariant),
    # where the user's code, not the runner, computes what it takes over
    user_install: Callable | None = None
    # an HF model's base plan -> None, or BadInput for a layout it does not cover: run before
    # any world starts, so the refusal is one line
    check_plan: Callable | None = None

    def __post_init__(self):
        if self.installs not in INSTALLS:
            raise ValueError(f"fix {self.name}: installs={self.installs!r}, expected one of {INSTALLS}")
        bad = [t for t in self.takes_over if t not in TAKES_OVER]
        if bad:
            raise ValueError(f"fix {self.name}: takes_over {bad}, expected any of {TAKES_OVER}")

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


def _switch(model, plan, world):
    # nothing to wrap: apply_fixes marks the fix active, and the code that computes what it
    # takes over asks fixes/state.py
    from contextlib import nullcontext

    return nullcontext()


def _check_moe(base_plan):
    from tpdiag.fixes.moe import check_plan

    check_plan(base_plan)


def _ce_mode():
    from tpdiag.fixes.vocab_loss import invariant_cross_entropy_mode

    return invariant_cross_entropy_mode()


register(Fix("tp-invariant-linear", ("row-parallel-reduction", "column-parallel-dgrad"),
             ("RowwiseParallel forward", "ColwiseParallel dgrad",
              *(f"MoE experts: {m}" for m in MOE_LAYOUTS)),
             "fp32 partials per fixed K group + one tree all-gather of [tokens, N] per layer "
             "(no weight all-gather)", _linear("tp-invariant-linear"), grouped=True,
             # batch-invariant too: a row-parallel Linear's CPU GEMM runs in fixed row blocks only under it
             batch_invariant=2,
             check_plan=_check_moe))
register(Fix("invariant-gemm", ("shape-dependent-gemm", "batch-variant-kernel"),
             ("ColwiseParallel forward/wgrad", "linear/bias/embedding weight grads across micro-batches"),
             "column GEMMs whose bits do not depend on the shard or the rows per call: the invariant Triton GEMM (CUDA), fixed N blocks x fixed 16-row blocks of one shape (CPU); "
             "with micro-batches an fp32 carry per weight, walked in fixed token blocks (an fp32 copy of the weights during the step)",
             _linear("invariant-gemm"), grouped=True, batch_invariant=1, carries_grads=True))
register(Fix("invariant-vocab-softmax", ("vocab-parallel-softmax",),
             ("vocab-parallel log-softmax / cross-entropy",),
             "exp-sums per fixed vocab group, one tree all-gather of [tokens] floats",
             _switch, installs="runner-switch", grouped=True, batch_invariant=5, takes_over=("loss",),
             user_install=_ce_mode))
register(Fix("invariant-grad-norm", ("grad-norm",), ("global grad norm + clip",),
             "grads gathered whole, float64 norm; torch's clip coefficient from it",
             _switch, installs="runner-switch", takes_over=("grad-norm",)))
def _norm(model, plan, world):
    from tpdiag.fixes.norm import norm_fix

    return norm_fix(model, plan, world)


register(Fix("invariant-norm-grad", ("norm-weight-grad",),
             ("RMSNorm under SequenceParallel", "replicated RMSNorm weight grads across micro-batches",
              "per-head LayerNorm q/k norms ([heads, head_dim] weight: Cohere's use_qk_norm)"),
             "weight-grad sums per fixed sequence group, one tree all-gather of [hidden] per norm; "
             "with micro-batches a replicated norm's weight grad into an fp32 carry in fixed token blocks",
             _norm, grouped=True, batch_invariant=4, carries_grads=True,
             takes_over=("head-norm-grad-reduce",)))
def _det(model, plan, world):
    from tpdiag.kernels.det_collectives import deterministic_all_reduce

    return deterministic_all_reduce()


register(Fix("deterministic-collectives", ("collective-nondeterminism",),
             ("_c10d_functional::all_reduce (DTensor Partial -> Replicate)",),
             "all-gather + rank-ordered sum: deterministic at a fixed TP, not TP-invariant", _det,
             installs="op-override"))


def _attention(model, plan, world):
    from tpdiag.fixes.attention import attention_fix

    return attention_fix(model, plan, world)


register(Fix("invariant-attention", ("attention-kernel",), ("F.scaled_dot_product_attention",),
             "own attention kernels, fixed tiles, no split-KV, separate dq pass (no atomics): Triton on "
             "CUDA, fwd+bwd ~1.1x cuDNN's at head_dim 64, 1.2x at 128 (H100, H200; docs/benchmarks.md); "
             "elementwise fp32 torch path with fixed key blocks on the CPU or with an explicit mask (slow; a decode query = its causal prefill row)",
             _attention, installs="op-override", batch_invariant=3))
