"""The reasons the cause judge's rules give (diff/judge.py), in words a user reads in the
verdict line and the report."""

WHY_AXIS = {
    "param_grad": ("the weight grad sums over every token; with gradient accumulation the tokens "
                   "are summed per micro-batch and the micro-batches' sums added, another order"),
    "loss": ("the step's loss is the micro-batches' shares added, not one mean over every token: "
             "another summation order"),
    "grad_norm": "the grads it reads were accumulated over micro-batches in another order",
}
# a loss beyond its bound across micro-batch sizes whose logits were bitwise equal: the pieces'
# losses, weighted as runner/micro.py weights them, are not the whole batch's loss
WHY_LOSS_MEAN = ("its logits were bitwise equal, and the micro-batches' losses, each weighted as "
                 "Target.loss_mean says (default \"token\": by its share of the tokens), do not add up to "
                 "the whole batch's loss: the loss is not that kind of mean (a mean over sequences, e.g. "
                 "GRPO's per-sequence token means, is loss_mean=\"sequence\"; a sum, \"sum\"), or it couples "
                 "the sequences of a call. A trainer that weights micro-batches this way moves its loss "
                 "with the micro-batch size")
WHY_LOSS_REDUCED = ("the logits it read were whole on every rank (no vocab shard) and bitwise equal, and the "
                    "loss is within its rounding bound: the loss function reduces over the ranks in its own code "
                    "(each rank's partial sum - of its tokens, say - added by an all-reduce, in another order than "
                    "TP=1's one sum); no fix in the catalogue reorders a user's loss")
WHY_MICRO_BATCH = ("its inputs were bitwise equal and only the number of rows in its call changed (micro-batch "
                   "size): its result for a row depends on how many rows share the call")
WHY_DECODE = ("its inputs were bitwise equal and only the positions per call changed (decode: the "
              "prompt in one call, then one position per sequence per call, against prefill's one "
              "call over the sequence): its result for a row depends on how many rows share the call")
WHY_ATTENTION = ("its inputs were bitwise equal and only the attention implementation changed (eager "
                 "matmul + softmax, SDPA, or another SDPA backend): another kernel sums in another "
                 "order")
# along the micro-batch and decode axes, where a record's inputs were bitwise equal
WHY_ROWS = {
    "micro_batch": ("its exact result for a row depends on the other rows of its call (e.g. an expert "
                    "capacity computed from the tokens per call, statistics over the batch) - a real "
                    "difference between micro-batch sizes, not rounding"),
    "mode": ("its exact result in decode is not prefill's (a decode-only code path, or a dependence on "
             "what else is in its call: a decode call holds one position per sequence) - a real "
             "difference between decode and prefill, not rounding"),
}
WHY_COUPLED = {
    "micro_batch": ("either a kernel whose rounding depends on the rows per call flipped that choice "
                    "(rounding), or the module's result for a row depends on the other rows of its call, "
                    "e.g. an expert capacity computed from the tokens per call or statistics over the "
                    "batch (a real difference, not rounding); nothing here tells the two apart"),
    "mode": ("either a kernel whose rounding depends on the positions per call flipped that choice "
             "(rounding), or the module's result depends on what else is in its call - decode calls hold "
             "one position per sequence (a real difference, not rounding); nothing here tells the two apart"),
}
WHY_NOISE = ("the reference does not reproduce itself: a kernel is "
             "nondeterministic run to run, which no TP layout explains")
WHY_TP1 = ("beyond the grad norm's triangle bound, but nothing is sharded at TP=1 on either "
           "side and no float64 re-execution found it wrong")
