"""Causes along the axes besides TP. Two configurations that differ only in micro-batch size (or
in prefill vs decode) run the same layout, the same weights and the same rows: where the first
divergence's inputs are bitwise equal, the only thing that changed is how many rows shared the
call (a decode call holds one position per sequence, prefill the whole sequence), so the cause is
a batch-variant computation (rounding) - `attention-kernel` where the op is attention - unless
the float64 oracle or a rounding bound found the result far from the exact one, which no
re-blocking explains (the oracle's bug verdict stays)."""
from __future__ import annotations

from tpdiag.records.causes import cause_class

BATCH_VARIANT = "batch-variant-kernel"

_WHY = {
    "param_grad": ("the weight grad sums over every token; with gradient accumulation the tokens "
                   "are summed per micro-batch and the micro-batches' sums added, another order"),
    "loss": ("the step's loss is the micro-batches' shares added, not one mean over every token: "
             "another summation order"),
    "grad_norm": "the grads it reads were accumulated over micro-batches in another order",
}


_WHY_DECODE = ("its inputs were bitwise equal and only the positions per call changed (decode: the "
               "prompt in one call, then one position per sequence per call, against prefill's one "
               "call over the sequence): its result for a row depends on how many rows share the call")


_WHY_ATTENTION = ("its inputs were bitwise equal and only the attention implementation changed (eager "
                  "matmul + softmax, SDPA, or another SDPA backend): another kernel sums in another "
                  "order")


def name_batch_variant(entry: dict, axis: str) -> None:
    """entry: one configuration's summary entry; axis: what it differs from the reference in."""
    if axis not in ("micro_batch", "mode", "attention"):
        return
    fd = entry.get("first_divergence")
    if not fd or cause_class(fd.get("cause")) in ("bug", "non-finite"):
        return
    if fd.get("cause") not in (None, "unknown") and cause_class(fd["cause"]) != "rounding":
        return
    fd["layout_cause"] = fd.get("cause")
    fd.pop("why", None)
    if axis == "attention":
        # the implementation itself is what changed: the attention module's own kernel (rounding,
        # as the float64 oracle's verdict above would have said otherwise)
        fd["cause"] = "attention-kernel"
        fd["why"] = _WHY_ATTENTION
        return
    if axis == "mode":
        from tpdiag.records.ops import SDPA_OPS, is_op_of

        fd["cause"] = "attention-kernel" if is_op_of(fd.get("op"), SDPA_OPS) else BATCH_VARIANT
        fd["why"] = _WHY_DECODE
        return
    fd["cause"] = BATCH_VARIANT
    fd["why"] = _WHY.get(fd.get("kind"), (
        "its inputs were bitwise equal and only the number of rows in its call changed (micro-batch "
        "size): its result for a row depends on how many rows share the call"))
