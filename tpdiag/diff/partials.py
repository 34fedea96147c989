"""Per-rank partial sums in a diff: a replica whose ranks' copies add up to the reference's value
(each rank's share of a sum) - never reduced where a replica belongs, or reduced by the very module
it feeds (a user's own all-reduce module), which is no difference at all."""
from __future__ import annotations

import torch


def partial_sum(row: dict, ref: torch.Tensor, copies: list) -> None:
    """A replica whose ranks' copies add up to the reference is a rank-partial sum that was
    never all-reduced (a replicated parameter updated from activations that are sharded, its
    grad summed over each rank's columns only). Marked when the sum over ranks is at least
    1000x closer to the reference than the copy furthest from it: a wrong replica of any other
    kind does not sum to the reference."""
    if not ref.is_floating_point() or any(c.shape != ref.shape for c in copies) or len(copies) < 2:
        return
    r = ref.to(torch.float64)
    off = max(float((c.to(torch.float64) - r).abs().max()) for c in copies)
    total = torch.stack([c.to(torch.float64) for c in copies]).sum(0)
    sum_off = float((total - r).abs().max())
    if off > 0 and sum_off * 1000 <= off:
        row["rank_partial_sum"] = {"sum_max_abs": sum_off, "copy_max_abs": off}


def reduced(rows: list, tensors: dict, uncompared: list) -> None:
    """A module's forward input that each rank holds as its share of a sum (partial_sum) which the
    module itself reduces - its output of that call is one value on every rank: the user's own
    all-reduce written as an nn.Module (Megatron's reduce-from-model-parallel region). A partial,
    not a replica never reduced: left uncompared as a DTensor partial is; were it never reduced,
    the module's output would show it. (Read `rank-inconsistent-replica`, a BUG, on correct code.)"""
    outs = {(r["step"], r["module"], r.get("call")): r for r in rows
            if r["phase"] == "forward" and r["kind"] == "out"}
    keep = []
    for r in rows:
        if r["phase"] == "forward" and r["kind"] == "in" and r.get("rank_partial_sum") \
                and r.get("rank_consistent") is False:
            o = outs.get((r["step"], r["module"], r.get("call")))
            if o is not None and o.get("rank_consistent") is not False:
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call")
                                      if k in r},
                                   "why": "unreduced partial sum (the ranks' copies add up to the reference; "
                                          "the module reduces it: its output is one value on every rank)"})
                tensors.pop(r["key"], None)
                continue
        keep.append(r)
    rows[:] = keep
