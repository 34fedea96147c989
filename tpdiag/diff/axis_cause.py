"""Causes along the axes besides TP. Two configurations that differ only in micro-batch size run
the same layout, the same weights and the same rows: where the first divergence's inputs are
bitwise equal, the only thing that changed is how many rows shared the call, so the cause is a
batch-variant computation (rounding) - unless the float64 oracle or a rounding bound found the
result far from the exact one, which no re-blocking explains (the oracle's bug verdict stays)."""
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


def name_batch_variant(entry: dict, axis: str) -> None:
    """entry: one configuration's summary entry; axis: what it differs from the reference in."""
    if axis != "micro_batch":
        return
    fd = entry.get("first_divergence")
    if not fd or cause_class(fd.get("cause")) in ("bug", "non-finite"):
        return
    if fd.get("cause") not in (None, "unknown") and cause_class(fd["cause"]) != "rounding":
        return
    fd["layout_cause"] = fd.get("cause")
    fd["cause"] = BATCH_VARIANT
    fd.pop("why", None)
    fd["why"] = _WHY.get(fd.get("kind"), (
        "its inputs were bitwise equal and only the number of rows in its call changed (micro-batch "
        "size): its result for a row depends on how many rows share the call"))
