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
    c64 = torch.stack([c.to(torch.float64) for c in copies])
    off, sum_off, adds = adds_up(c64, r, ref.dtype)
    if adds:
        row["rank_partial_sum"] = {"sum_max_abs": sum_off, "copy_max_abs": off}
        return
    # each rank's share of a max (a shard's own max before the all-reduce MAX of an online softmax):
    # the elementwise max (or min) over the ranks' copies is the reference's value
    for how, agg in (("max", torch.amax), ("min", torch.amin)):
        got = float((agg(torch.stack([c.to(torch.float64) for c in copies]), 0) - r).abs().max())
        if off > 0 and got * 1000 <= off:
            row["rank_partial_extreme"] = {"reduce": how, "reduced_max_abs": got, "copy_max_abs": off}
            return
    near_shares(row, off, sum_off, c64, r, ref.dtype)


def adds_up(c64: torch.Tensor, r: torch.Tensor, dtype) -> tuple[float, float, bool]:
    """(how far the copy furthest from the reference is, how far the copies' sum is, whether that
    sum is the reference's: at least 1000x closer than the furthest copy, or element by element
    within the shares' and the reference's roundings). c64: the ranks' copies stacked, r the
    reference, both float64; dtype the record's."""
    off = float((c64 - r).abs().max())
    err = (c64.sum(0) - r).abs()
    sum_off = float(err.max())
    # or, element by element, within the rounding of the shares and of the reference in their own
    # dtype: in bfloat16 each share is rounded at its own magnitude (2^-9 of it), so the shares of a
    # correct sum add up only to ~1/256 of a copy's distance - under the 1000x above. A correct
    # bf16 norm whose statistics a module of the user's own all-reduces (shard_stats.py:wd_ok,
    # rms_ok) read `sharding-bug` (reviewer hreview13)
    tol = PARTIAL_ROUNDINGS * torch.finfo(dtype).eps * (c64.abs().sum(0) + r.abs())
    adds = off > 0 and (sum_off * 1000 <= off or (off > float(tol.max()) and bool((err <= tol).all())))
    return off, sum_off, adds


def near_band(c64: torch.Tensor, r: torch.Tensor, dtype) -> float:
    """near_shares's band: NEAR_ROUNDINGS roundings of the largest |shares| + |reference|."""
    return NEAR_ROUNDINGS * torch.finfo(dtype).eps * float((c64.abs().sum(0) + r.abs()).max())


def near_shares(row: dict, off: float, sum_off: float, c64: torch.Tensor, r: torch.Tensor, dtype) -> None:
    """An activation grad whose ranks' copies add up to the reference only to within a few roundings
    of the tensor's largest magnitude, not element by element: marked `rank_partial_near`, which
    diff/judge.py reads `unknown` (the gate fails it), not `rank-inconsistent-replica`.

    Why not rounding: the element-wise test above bounds each element's error by the roundings of
    its result's own magnitude (|shares| + |reference|). An element computed as a difference of
    larger terms - a softmax backward p_i (g_i - sum_j p_j g_j), the router grad of a top-k MoE whose
    experts each rank runs a part of (its input's copy all-reduces the grad in backward), or an
    element whose exact value is 0 (sum_j p_j g_j over a top-k renormalisation is 0 exactly: the
    unselected experts' grads are rounding residue alone) - carries the roundings of those TERMS,
    which the record does not hold: in bfloat16 such elements of a correct split missed by 32x
    (moe_late_bug.py:shared_once, moe_bwd_bug.py:shared_beside). A bound from the tensor's largest
    magnitude instead (4 eps of it) is no bound of the terms either, and in bf16 accepts a wrong share
    of ~3% of the tensor's largest value: no rounding verdict is drawn from it.
    Why not a replica's BUG: copies that add up to the reference this closely are shares of a sum,
    and a share test that cannot see the cancelling terms does not show them wrong either. Outside
    this band (the sum further from the reference than 4 eps of the largest |shares| + |reference|)
    the record stays `rank-inconsistent-replica`, a BUG, as before; an activation grad only (the
    grad a backward splits over the ranks' own experts or columns), where the shares' sum is what
    the backward reduces next."""
    if row.get("phase") != "backward" or row.get("kind") != "grad_out" or off <= 0:
        return
    band = near_band(c64, r, dtype)
    if sum_off <= band < off:
        row["rank_partial_near"] = {"sum_max_abs": sum_off, "copy_max_abs": off, "band": band}


# the roundings (in eps of the record's dtype, times the tensor's largest |shares| + |reference|)
# within which shares that miss the element-wise test read `unknown`, not a replica's BUG
NEAR_ROUNDINGS = 4


# the roundings (in eps of the record's dtype, times the magnitudes summed) the ranks' shares may
# miss the reference by and still be read as its partial sums
PARTIAL_ROUNDINGS = 4


def reduced(rows: list, tensors: dict, uncompared: list) -> None:
    """A module's forward input that each rank holds as its share of a sum (partial_sum) which the
    module itself reduces - its output of that call is one value on every rank: the user's own
    all-reduce written as an nn.Module (Megatron's reduce-from-model-parallel region). A partial,
    not a replica never reduced: left uncompared as a DTensor partial is; were it never reduced,
    the module's output would show it. (Read `rank-inconsistent-replica`, a BUG, on correct code.)"""
    outs, every_out = {}, {}
    for r in rows:
        if r["phase"] == "forward" and r["kind"] == "out":
            outs[(r["step"], r["module"], r.get("call"))] = r
            every_out.setdefault((r["step"], r["module"], r.get("call")), []).append(r)
    drifted = updated_steps(rows)
    keep = []
    for r in rows:
        share = r.get("rank_partial_sum") or r.get("rank_partial_extreme")
        if r["phase"] == "forward" and r["kind"] == "in" and share and r.get("rank_consistent") is False:
            o = outs.get((r["step"], r["module"], r.get("call")))
            if o is not None and o.get("rank_consistent") is not False:
                how = share.get("reduce", "sum")
                what = ("add up to the reference" if how == "sum" else f"have the reference as their elementwise {how}")
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call",
                                                        "shares_hash") if k in r},
                                   "why": f"unreduced partial {how} (the ranks' copies {what}; "
                                          "the module reduces it: its output is one value on every rank)"})
                tensors.pop(r["key"], None)
                continue
        elif r["phase"] == "forward" and r["kind"] == "in" and r.get("rank_consistent") is False:
            o = outs.get((r["step"], r["module"], r.get("call")))
            if o is not None and o.get("rank_consistent") is True and _combined(r, every_out[(r["step"], r["module"], r.get("call"))]):
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call")
                                      if k in r},
                                   "why": f"{COMBINED} (the module makes one value on every rank of them, "
                                          "1000x or more closer to the reference's than the ranks' values are)"})
                tensors.pop(r["key"], None)
                continue
            if o is not None and o.get("rank_consistent") is True and str(r["step"]) in drifted:
                # shares made from weights each side's own optimizer wrote: they add up to this side's
                # sum, never the reference's (a correct bf16 row-parallel MLP at --steps 3 read
                # `sharding-bug` at step 1, later_step.py:fast_sum). No evidence either way: left
                # uncompared as a partial, the module's output - one value on every rank - compared and
                # judged on this side's own inputs and weights (diff/oracle_own.py) instead
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call",
                                                        "shares_hash") if k in r}, "why": DRIFTED})
                tensors.pop(r["key"], None)
                continue
            if o is not None and o.get("rank_consistent") is True:
                # the module makes one value of the ranks' copies (its own all-reduce): they are
                # shares of a sum, not replicas - shares that do not add up were computed wrong
                # before it (a norm's statistics over the rank's own columns), no replica left
                # unreduced (shard_stats.py:rms_local read `rank-inconsistent-replica` here)
                r["shares_of"] = r["module"]
        keep.append(r)
    rows[:] = keep


COMBINED = "the ranks' own values"
# the reason every unreduced-partial record left uncompared starts with (left_out.SHARE_WHYS too)
UNREDUCED = "unreduced partial"


def unreduced(m: dict) -> bool:
    """Was this uncompared record left out as an unreduced partial (each rank's share of a sum)?"""
    return str(m.get("why") or "").startswith(UNREDUCED)
# starts as left_out.SHARE_WHYS's shares do: a hash-first pass's region pass reads them as shares too
DRIFTED = ("unreduced partial sum at a step whose weights differ from the reference's (each side's own "
           "optimizer update: the shares add up to this side's sum, not the reference's; the module reduces "
           "them, its output is compared)")


def updated_steps(rows: list) -> set[str]:
    """The steps that start from parameters some earlier optimizer step left differing from the
    reference's (a `param` record of an earlier step not bitwise): from the first such step on every
    value the weights make differs by the updates' drift, not by that step's rounding - but a step
    re-anchored at the reference's state (`--anchor`)."""
    def step(r):
        try:
            return int(r.get("step"))
        except (TypeError, ValueError):
            return None
    moved = [step(r) for r in rows if r["phase"] == "optimizer" and r["kind"] == "param" and not r["bitwise"]]
    moved = [s for s in moved if s is not None]
    if not moved:
        return set()
    from tpdiag.diff.anchored import steps as anchored_steps

    # a step re-anchored at the reference's state starts from its weights
    anchored = anchored_steps(rows)
    return {str(s) for s in {step(r) for r in rows} if s is not None and s > min(moved) and s not in anchored}


def reduced_outputs(rows: list, tensors: dict, uncompared: list) -> None:
    """A module's forward output that each rank holds as its share of a sum (partial_sum), handed
    as is - the same bytes on every rank - to consumers that each reduce it (reduced above left
    that input uncompared): Megatron's RowParallelLinear with reduce_results=False (its partial and
    its bias returned, the all-reduce a module of the caller's). A partial, not a replica: left
    uncompared as the input is. (tests/models/planted/mega_split.py:split_ok read BUG at the row
    layer's output.) A partial that a consumer takes for a replica stays a finding: a row layer
    that forgets its all-reduce, its output summed into the residual (layers.py RowLinear
    "forgotten")."""
    shares = {(m["step"], m["module"], m.get("shares_hash")) for m in uncompared
              if m.get("shares_hash") and (m["phase"], m["kind"]) == ("forward", "in")
              and unreduced(m)}
    drifted = updated_steps(rows)
    keep = []
    for r in rows:
        consumers = [c for c in r.get("consumers") or () if isinstance(c, str)]
        # at a step whose weights differ (reduced's DRIFTED) the shares add up to this side's sum, not
        # the reference's: the same bytes handed only to modules that reduce them are left as their
        # input is (mega_split.py:split_ok, bf16 --steps 3, read `rank-inconsistent-replica` at step 1)
        if (r["phase"], r["kind"]) == ("forward", "out") and consumers \
                and (r.get("rank_partial_sum") or str(r["step"]) in drifted) \
                and r.get("rank_consistent") is False and r.get("shares_hash") \
                and all((r["step"], c, r["shares_hash"]) in shares for c in consumers):
            what = ("the ranks' copies add up to the reference" if r.get("rank_partial_sum")
                    else "at a step whose weights differ from the reference's: the ranks' copies add up to this "
                         "side's sum, not the reference's")
            uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call")
                                  if k in r},
                               "why": f"unreduced partial sum ({what}; "
                                      f"{', '.join(consumers)} reduces it: its output is one value on every rank)"})
            tensors.pop(r["key"], None)
            continue
        keep.append(r)
    rows[:] = keep


def _combined(row: dict, outs: list) -> bool:
    """The ranks' different values of a module input that the module combines into outputs all of
    which are at least 1000x closer to the reference than the input's copies (partial_sum's test):
    each rank's own statistic (a shard's mean and M2, combined by Chan's formula after an
    all-gather) that make the reference's value, not a replica nor shares computed wrong - those
    leave the output as far as they are (shard_stats.py:rms_local). (chan_module in
    tests/models/planted/vocab_lookup.py read BUG at the combining module's input.)"""
    off = row.get("max_abs")
    if not off or not outs:
        return False
    return all(o.get("max_abs") is not None and o.get("rank_consistent") is not False
               and o["max_abs"] * 1000 <= off for o in outs)


def reduced_after_backward(rows: list, tensors: dict, uncompared: list) -> None:
    """A replicated parameter's grad that each rank holds as its share of a sum (partial_sum) when
    its backward ends, and that the user's own loop all-reduces before the optimizer step:
    Megatron-style sequence parallelism (norm weights applied to each rank's sequence shard as
    plain tensors, their grads all-reduced in finalize_model_grads). The capture records a grad
    where autograd accumulates it, before that all-reduce; the parameter after the step (cap.params)
    being one value on every rank shows it was reduced. Left uncompared as a DTensor partial is.
    Never reduced, the ranks step from different grads and the parameter's replicas part: the
    grad stays a finding, and so does it where no parameter after the step is recorded (fail closed).
    (tests/test_user_sp_norm.py: the correct loop read `rank-inconsistent-replica`, a BUG.)"""
    after = {(r["step"], r["module"], r["name"]): r for r in rows
             if r["phase"] == "optimizer" and r["kind"] == "param"}
    keep = []
    for r in rows:
        if r["phase"] == "backward" and r["kind"] == "param_grad" and r.get("rank_partial_sum") \
                and r.get("rank_consistent") is False:
            p = after.get((r["step"], r["module"], r["name"]))
            if p is not None and p.get("rank_consistent") is True:
                uncompared.append({**{k: r[k] for k in ("key", "idx", "step", "phase", "module", "kind", "name", "call")
                                      if k in r},
                                   "why": "unreduced partial grad (the ranks' copies add up to the reference; "
                                          "reduced after the backward: the parameter after the step is one value "
                                          "on every rank)"})
                tensors.pop(r["key"], None)
                continue
        keep.append(r)
    rows[:] = keep


def drifted_grad_shares(rows: list, uncompared: list) -> None:
    """An activation grad whose ranks' copies, at the first step, were shown to be each rank's share
    of a sum the backward reduces later (partial_sum: they added up to the reference, left uncompared;
    or near_shares: within the band), and which at a step whose weights differ (updated_steps) add up
    to nothing the reference holds: the same code makes the same kind of value, but the shares of this
    side's own drifted sum (a top-k MoE's router grad, its experts chosen anew: 1.27 of the reference's
    norm off at step 1 in bf16) are no evidence of a replica's BUG, nor of rounding. Marked
    `rank_partial_drifted`, which diff/judge.py reads `unknown` (the gate fails it), never uncompared:
    a wrong share or replica at such a step is not told from a correct one by these records.
    (moe_bwd_bug.py:shared_beside, correct, bf16 --tp 1,2 --steps 3 read `rank-inconsistent-replica`
    at steps 1 and 2, gate 4.)"""
    drifted = updated_steps(rows)
    if not drifted:
        return

    def where(r):
        return (r["module"], r.get("call"), r["name"])
    shares = {where(m): str(m["step"]) for m in uncompared
              if (m.get("phase"), m.get("kind")) == ("backward", "grad_out")
              and unreduced(m)}
    for r in rows:
        if (r["phase"], r["kind"]) == ("backward", "grad_out") \
                and (r.get("rank_partial_near") or r.get("rank_partial_flip")) and str(r["step"]) not in drifted:
            shares.setdefault(where(r), str(r["step"]))
    for r in rows:
        if (r["phase"], r["kind"]) != ("backward", "grad_out") or r.get("rank_consistent") is not False \
                or str(r["step"]) not in drifted or r.get("rank_partial_sum") or r.get("rank_partial_near") \
                or r.get("rank_partial_flip"):
            continue
        first = shares.get(where(r))
        if first is not None and first not in drifted:
            r["rank_partial_drifted"] = {"shares_at": first}
