"""A captured loss judged from its inputs to first order: the user's own loss, no code to re-run.

In a diff of captures nothing re-executes the user's loss (compare runs Target.loss again in
float64), and the built-in logprob bound assumes a cross-entropy over the logits records that a
capture does not write. So an RL team's loss term computed on the LOCAL vocab shard (an entropy
bonus from the shard's own softmax, its shard entropies summed over the ranks) moved the loss by
0.6% and every grad with it, and the capture read "rounding only": its first divergence is a
row-parallel reduction, and the loss had no bound.

The loss L is a function of the model's outputs z (and of the batch, equal at both sides). Its
change between the sides is, to second order, the trapezoid <(g_ref + g_N) / 2, z_N - z_ref> with g
each side's recorded grad of L at z (the grad_out of the root module), plus what computing L in
another order rounds: a backward-stable computation is the exact one on inputs moved by a few
roundings each, at most k u sum_i |g_i| |z_i| (+ k u |L| for the last operations). A loss that
moved by more than twice the trapezoid plus 4096 such roundings (and 16 of the inputs' own dtype,
for a loss computed in a 16-bit dtype) computes another function of its inputs at TP > 1. Judged
only where that is the whole story: one model call, one output grad and one loss in the step,
every floating output that differs with its grad at both sides, no router flip.
"""
from __future__ import annotations

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.diff.bounds import unmasked
from tpdiag.records.keys import root_of

ROUNDINGS = 4096    # of the loss's dtype, per unit of sum |g| |z|
INPUT_ROUNDINGS = 16  # of the outputs' dtype (a loss computed in bf16 rounds there)
MARGIN = 2.0        # on the trapezoid (its third-order rest)


def _u(dtype) -> float:
    return UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32])


CHUNK = 1 << 24  # elements a float64 piece (128 MiB): a 2048 x 128k logits pair whole was 4 x 2.1 GB


def _chunks64(*ts):
    """Equal-shaped tensors' float64 pieces side by side, along their first dim (rows whole)."""
    n = ts[0].shape[0] if ts[0].dim() else 1
    per_row = max(1, ts[0].numel() // max(1, n))
    step = max(1, CHUNK // per_row)
    if ts[0].dim() == 0:
        yield tuple(t.double() for t in ts)
        return
    for i in range(0, n, step):
        yield tuple(t[i:i + step].double() for t in ts)


def first_order_bound(dd, step: int, rows: list[dict]) -> None:
    """Set the loss row's bound (and beyond_bound) of `step` from the model's outputs and their
    grads, where dd holds them all (a capture: rows without a loss bound of their own)."""
    from tpdiag.diff.router import flipped

    losses = [r for r in rows if r["kind"] == "loss"]
    if len(losses) != 1 or losses[0].get("bound") is not None or losses[0]["bitwise"]:
        return
    loss = losses[0]
    root = root_of({r.get("module") for r in rows})
    outs = [r for r in rows if r["phase"] == "forward" and r["module"] == root and r["kind"] == "out"]
    grads = {r["name"]: r for r in rows if r["phase"] == "backward" and r["module"] == root
             and r["kind"] == "grad_out"}
    if not outs or any(r.get("call") != 0 for r in outs) or any(r.get("call") != 0 for r in grads.values()):
        return  # more than one model call (micro-batches): which loss is whose is not known here
    if any(flipped(r) for r in rows) or loss["key"] not in dd.tensors:
        return
    la, lb = dd.tensors[loss["key"]]
    if la.numel() != 1 or not la.is_floating_point():
        return
    a, b = float(la.double().reshape(-1)[0]), float(lb.double().reshape(-1)[0])
    pred = mag = 0.0
    u_in = 0.0
    for o in outs:
        if o["key"] not in dd.tensors:
            return
        za, zb = dd.tensors[o["key"]]
        if not za.is_floating_point():
            if not o["bitwise"]:
                return
            continue
        g = grads.get(o["name"])
        if g is None or g["key"] not in dd.tensors:
            if not o["bitwise"]:
                return  # an output that moved with no grad to weigh it by
            continue
        ga, gb = dd.tensors[g["key"]]
        if ga.shape != za.shape or gb.shape != zb.shape or za.shape != zb.shape:
            return
        for za64, zb64, ga64, gb64 in _chunks64(za, zb, ga, gb):
            za64, zb64 = unmasked(za64, zb64)  # a masked logit (-inf at both sides) moved by nothing
            if not all(bool(torch.isfinite(t).all()) for t in (za64, zb64, ga64, gb64)):
                return
            pred += float(((ga64 + gb64) / 2 * (zb64 - za64)).sum())
            mag += float((torch.maximum(ga64.abs(), gb64.abs()) * torch.maximum(za64.abs(), zb64.abs())).sum())
        u_in = max(u_in, _u(za.dtype))
    u = _u(la.dtype)
    bound = MARGIN * abs(pred) + ROUNDINGS * u * (mag + max(abs(a), abs(b))) + INPUT_ROUNDINGS * u_in * mag
    diff = abs(b - a)
    loss["bound"] = bound
    loss["bound_ratio"] = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
    loss["beyond_bound"] = not diff <= bound  # a NaN is beyond, not within
    loss["bound_model"] = ("first order: the loss's change predicted from its inputs' (the model's outputs "
                           "times their recorded grads) plus its own rounding")


GRAD_ROUNDINGS = 1024  # per unit of the output's largest change (a softmax's grad moves by |dz|)
GRAD_SPREAD = 0.5      # of the grad's rows beyond it


def grad_bound(dd, rows: list[dict]) -> None:
    """The grad of an output no module consumed (the root's output in a capture: what the user's
    loss returned for it), judged row by row against how far that output moved.

    A loss's grad at its input z moves, for a reordering, by the input's own change times the
    loss's curvature, plus its own few roundings: a softmax-based loss (cross-entropy, an entropy
    bonus, a KL, a PPO ratio) has d(softmax)/dz at most 1 per unit of |dz|, so a row's grad moves
    relative to itself by about max |dz| (logits are compared in absolute terms: the softmax is
    shift-invariant). A loss whose BACKWARD is wrong at TP > 1 (a normaliser all-reduced with an
    identity backward where each rank's terms differ, loss_parallel's log_softmax outside a
    cross-entropy) leaves the loss itself bitwise and moves every row's grad by 1e-3 of itself
    while the logits moved by 1e-7: it read "rounding only". Called a bug where at least half of
    the rows moved by more than 1024 times max(max |dz|, the grad's unit roundoff) of
    themselves: a discrete choice in the loss flipped by rounding (a mask at a threshold) moves
    the few rows at the threshold, not most of them."""
    outs = {(r["step"], r["module"], r.get("call"), r["name"]): r for r in rows
            if r.get("phase") == "forward" and r.get("kind") == "out"}
    roots: dict = {}  # step -> the root's outputs' value pairs (what the loss read)
    # the root's record name: "(root)" where its child is named "model" (an HF CausalLM, whose
    # `model` child returns hidden states, not what the loss read): tests/user_loss_hf.py's
    # entropy_grad read `rounding only` while "model" was taken for the root here
    root = root_of({r.get("module") for r in rows})
    for r in outs.values():
        if r["module"] == root and r["key"] in dd.tensors:
            roots.setdefault(r["step"], []).append(dd.tensors[r["key"]])
    for g in rows:
        if (g.get("phase") != "backward" or g.get("kind") != "grad_out" or g.get("consumers") or g["bitwise"]
                or g.get("bound") is not None or g.get("rank_consistent") is False
                or g.get("scale") is not None):  # one factor: diff/scale.py names it, with its reason
            continue
        o = outs.get((g["step"], g["module"], g.get("call"), g["name"]))
        if o is None or o["key"] not in dd.tensors or g["key"] not in dd.tensors:
            continue
        (za, zb), (ga, gb) = dd.tensors[o["key"]], dd.tensors[g["key"]]
        # only the loss's own input: the root's output (or the module whose output the root returns,
        # the same values at both sides). An inner output no probed module consumed (a projection
        # read by ops) gets its grad through the rest of the backward, whose own noise - a
        # nondeterministic kernel - is no loss's curvature (tests/test_diagnosis.py read a false BUG)
        if g["module"] != root and not any(
                ra.shape == za.shape and rb.shape == zb.shape and torch.equal(ra, za) and torch.equal(rb, zb)
                for ra, rb in roots.get(g["step"], ())):
            continue
        if (not za.is_floating_point() or not ga.is_floating_point() or za.shape != ga.shape
                or zb.shape != gb.shape or za.shape != zb.shape or za.dim() < 2 or za.numel() < 16):
            continue
        width = za.shape[-1]
        dz, scales, moved, finite = 0.0, [], [], True
        for z1, z2, g1, g2 in _chunks64(*(t.reshape(-1, width) for t in (za, zb, ga, gb))):
            z1, z2 = unmasked(z1, z2)  # a masked logit (-inf at both sides) moved by nothing
            if not all(bool(torch.isfinite(t).all()) for t in (z1, z2, g1, g2)):
                finite = False
                break
            dz = max(dz, float((z2 - z1).abs().max()))
            scales.append(torch.maximum(g1.norm(dim=-1), g2.norm(dim=-1)))
            moved.append((g2 - g1).norm(dim=-1))
        if not finite:
            continue
        scale = torch.cat(scales)
        live = scale > 0
        if int(live.sum()) < 2:
            continue
        rel = torch.cat(moved)[live] / scale[live]
        tol = GRAD_ROUNDINGS * max(dz, _u(ga.dtype), _u(za.dtype) if dz == 0 else 0.0)
        beyond = float((rel > tol).double().mean())
        if beyond < GRAD_SPREAD:
            continue
        worst = float(rel.median())
        g["bound_ratio"] = worst / tol
        # in the record's units, as every bound is shown ("max abs X > bound Y, R x beyond")
        g["bound"] = g["max_abs"] / g["bound_ratio"] if g.get("max_abs") else tol
        g["beyond_bound"] = True
        g["bound_model"] = (f"the loss's grad moved by {worst:.2g} of itself (median row, {100 * beyond:.0f}% of the "
                            f"rows beyond the bound) where its input moved by at most {dz:.2g}: "
                            "its backward computes another grad")
