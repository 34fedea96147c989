"""Causes along the axes besides TP. Two configurations that differ only in micro-batch size (or
in prefill vs decode) run the same layout, the same weights and the same rows: where the first
divergence's inputs are bitwise equal, the only thing that changed is how many rows shared the
call (a decode call holds one position per sequence, prefill the whole sequence), so the cause is
a batch-variant computation (rounding) - `attention-kernel` where the op is attention - unless
the float64 oracle or a rounding bound found the result far from the exact one, which no
re-blocking explains (the oracle's bug verdict stays). Far with a discrete choice inside (argmax,
top-k) stays `unknown`: a flipped near tie and a row that depends on its call's other rows (an
expert capacity) move the output alike (tests/test_batch_coupled.py)."""
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


_WHY_COUPLED = {
    "micro_batch": ("either a kernel whose rounding depends on the rows per call flipped that choice "
                    "(rounding), or the module's result for a row depends on the other rows of its call, "
                    "e.g. an expert capacity computed from the tokens per call or statistics over the "
                    "batch (a real difference, not rounding); nothing here tells the two apart"),
    "mode": ("either a kernel whose rounding depends on the positions per call flipped that choice "
             "(rounding), or the module's result depends on what else is in its call - decode calls hold "
             "one position per sequence (a real difference, not rounding); nothing here tells the two apart"),
}


_WHY_ROWS = {
    "micro_batch": ("its exact result for a row depends on the other rows of its call (e.g. an expert "
                    "capacity computed from the tokens per call, statistics over the batch) - a real "
                    "difference between micro-batch sizes, not rounding"),
    "mode": ("its exact result in decode is not prefill's (a decode-only code path, or a dependence on "
             "what else is in its call: a decode call holds one position per sequence) - a real "
             "difference between decode and prefill, not rounding"),
}


_WHY_ATTENTION = ("its inputs were bitwise equal and only the attention implementation changed (eager "
                  "matmul + softmax, SDPA, or another SDPA backend): another kernel sums in another "
                  "order")


def name_batch_variant(entry: dict, axis: str) -> None:
    """entry: one configuration's summary entry; axis: what it differs from the reference in."""
    if axis not in ("micro_batch", "mode", "attention"):
        return
    fd = entry.get("first_divergence")
    far = [v for v in ((fd or {}).get("oracle"), (fd or {}).get("op_oracle")) if v and v.get("far")]
    if far and cause_class(fd.get("cause")) == "bug" and axis in ("micro_batch", "mode") \
            and fd.get("kind") in ("out", "op") and not fd.get("why"):
        # the far verdict of a call whose inputs were bitwise equal: only the call's other rows
        # (or positions) changed, and the exact result moved with them
        same = next((v["choices_equal"] for v in far if v.get("choices_equal")), None)
        fd["why"] = ("its inputs were bitwise equal" + (f" and so were its discrete choices ({', '.join(same)}: "
                     "no flipped tie)" if same else "") + f", yet it is far from its float64 re-execution: "
                     f"{_WHY_ROWS[axis]}")
    if not fd or cause_class(fd.get("cause")) in ("bug", "non-finite"):
        return
    far = [v for v in (fd.get("oracle"), fd.get("op_oracle")) if v and v.get("far")]
    if any(v.get("discrete") for v in far):
        # far from its float64 re-execution, with a discrete choice inside: a batch-variant kernel
        # can flip a near tie (rounding), but a module whose exact result for a row depends on the
        # other rows of its call (an expert capacity, statistics over the batch) moves it as far -
        # neither is proven, so the cause stays unknown (fail closed), never batch-variant rounding
        if axis in ("micro_batch", "mode"):
            fd["why"] = (f"{fd.get('why') or 'far from its float64 re-execution, with a discrete choice inside'}"
                         f"; with its inputs bitwise equal, {_WHY_COUPLED[axis]}")
        return
    if fd.get("cause") not in (None, "unknown") and cause_class(fd["cause"]) != "rounding":
        return
    if fd.get("kind") == "in" and not (fd.get("op") and fd.get("op_oracle") and not fd["op_oracle"]["far"]):
        # an input that differs although every earlier record was equal: computed in the caller's
        # own code, whose inputs nothing here shows equal - no op there judged near its float64
        # value, so nothing says rounding (a wrong position or slice moves it as much)
        if fd.get("cause") in (None, "unknown"):
            fd["why"] = (f"{fd.get('detail', 'an input differs')}; no op there was judged against its float64 "
                         "re-execution (a view or indexing op is not recorded), so neither rounding nor a bug is shown")
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
