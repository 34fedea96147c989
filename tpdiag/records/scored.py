"""Which logprobs a step scored: the label mask, lined up with the recorded logprobs.

tpdiag's own steps (and docs/capture.md's script) record labels already shifted - label t is the
token logprob t is of, -100 where nothing is scored - so labels and logprobs have one size. A
transformers-style loop records `labels` as the model takes them (`model(ids, labels=ids)`: the
model shifts inside) and logprobs of positions 1..T-1 of each row: one fewer per row. Such
labels are lined up by the same shift; any other pair of sizes has no mask (every logprob is
counted)."""
from __future__ import annotations


def scored_mask(labels, logprobs):
    """A flat bool tensor over logprobs (True: scored), or None when the sizes do not line up."""
    if labels is None:
        return None
    n = logprobs.numel()
    if labels.numel() == n:
        return labels.flatten() != -100
    if labels.dim() >= 1 and labels.shape[-1] > 1 and labels[..., 1:].numel() == n:
        return labels[..., 1:].flatten() != -100
    return None
