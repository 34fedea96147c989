"""The logits' grad of the loss, judged against its float64 value: a user's own loss backward.

The grad of the logits is the grad of an output no module consumed: no module's float64 backward
re-executes it, and a user's hand-written vocab-parallel cross-entropy (Megatron's
_VocabParallelCrossEntropy as an autograd Function) computes it in its own backward, one vocab
shard per rank. A backward that is wrong on ONE rank (the one-hot not subtracted there, its shard
scaled, a softmax over its local exp sum) leaves the loss and logprobs exact and read as the
vocab-parallel softmax's rounding (tests/models/planted/vocab_loss.py).

Of a cross-entropy the grad is known in closed form from the logits z and the labels y: row t is
w_t (softmax(z_t) - onehot(y_t)), w_t the token's weight in the reduction (1/count for a mean over
the kept tokens, 0 for an ignored one, an RL loss's advantage, whatever the user's mean is). Each
side's weights are fitted to its own grad (least squares per row): a token's weight may be a
function of the logits (PPO's ratio exp(logp - logp_old) - the logits' rounding, or a vocab-parallel
log-softmax's on equal logits, moves it by many roundings, and can cross a clip bound), so what is
judged is the form within each row, which is where a one-rank vocab-shard mistake shows (a per-row
factor alone is not judged here; one factor over the whole grad is diff/scale.py's). This side's
grad is judged against o = w (softmax(z) - onehot(y)) in float64 from its own logits, as
diff/oracle.py judges a module against its float64 re-execution: far when

    ||g_N - o_N|| / ||o_N||  >  A(n) * max(||g_ref - o_ref|| / ||o_ref||, u)

The reference's own distance measures the rounding of this very loss, data and dtype, and with it
anything the closed form leaves out (a small z-loss, label smoothing): both sides carry that alike.
Judged only where the form holds at the reference (its relative distance at most FORM_ROUNDINGS
unit roundoffs): a loss of another form (a sum of other terms, a temperature) is left to the
layout's reordering cause, as before.

What the closed form leaves out is no rounding, though: it is the same function of the logits at
both sides, so it cancels in the change of each row's residual (g - w p) from the reference's to
this side's, which a reordering moves only by the grad's own roundings and by how far the logits
moved (a softmax's grad moves by at most about |dz| of itself per unit of it). Also far when

    ||(g_N - o_N) - (g_ref - o_ref)|| / ||o_N||  >  A(n) * max(u, max |z_N - z_ref|)

In bfloat16 (u = 2^-8) a PPO loss at temperature 0.7 is 13 roundings from the plain form, within
FORM_ROUNDINGS: by the reference's distance alone (5%, times A = 8) its logits' grad with the
target logit's grad TP times (an all-reduce whose backward sums the ranks' grads), or with the
temperature applied twice or to one side only, read `rounding only`
(tests/models/planted/rl_logprob.py, tests/test_rl_logprob.py).
"""
from __future__ import annotations

import torch

from tpdiag.diff import on_device
from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.diff.bounds import unmasked
from tpdiag.records.keys import record_key

FORM_ROUNDINGS = 64  # the reference within this many roundings of the closed form: a cross-entropy
BLOCK = 1 << 22      # float64 elements of [T, V] per block (32 MiB an array, whatever the vocab)


def judge_logits_grad(dd, world: int) -> None:
    """Set the oracle verdict on each divergent grad of the logits (a backward grad_out that no
    module consumed, of the logits' shape) whose reference grad is a cross-entropy's."""
    for row in dd.rows:
        if (row["phase"] != "backward" or row["kind"] != "grad_out" or row.get("consumers")
                or row["bitwise"] or row.get("nonfinite_mismatch") or row.get("oracle")
                or row.get("scale") is not None or row["key"] not in dd.tensors):
            # (one factor times the reference's: diff/scale.py names that bug, with its reason)
            continue
        step = row["step"]
        lk = record_key(step, "loss", "model", "logits", 0, "logits")
        yk = next((k for k in (record_key(step, "init", "model", "batch", 0, "labels"),
                               record_key(0, "init", "model", "batch", 0, "labels")) if k in dd.tensors), None)
        if lk not in dd.tensors or yk is None:
            continue
        (z1, zn), (y1, _) = dd.tensors[lk], dd.tensors[yk]
        g1, gn = dd.tensors[row["key"]]
        if not (g1.is_floating_point() and g1.shape == gn.shape == z1.shape == zn.shape
                and y1.numel() * z1.shape[-1] == z1.numel() and not y1.is_floating_point()):
            continue
        # its float64 softmaxes ([T, V] a side) on the parent's check device where it has one
        v = on_device.run(_verdict, z1, zn, y1, g1, gn, UNIT_ROUNDOFF.get(g1.dtype, UNIT_ROUNDOFF[torch.float32]),
                          world)
        if v is None:
            continue
        # computed here from the recorded logits and labels, no second-pass re-execution: the gate's
        # evidence check (diff/oracle_evidence.py) looks for none
        v["from"] = "logits"
        row["oracle"] = v
        row["bound_model"] = "float64 cross-entropy grad from the logits (each side's token weights its own fit)"
        if row.get("bound") is None or v["far"]:
            row["bound_ratio"] = max(row.get("bound_ratio") or 0.0, v["ratio"]) if v["far"] else v["ratio"]
            row["beyond_bound"] = v["far"]
        if v["far"]:
            v["what"] += _worst_shard(v)


def _verdict(z1, zn, y1, g1, gn, u: float, world: int) -> dict | None:
    from tpdiag.diff.oracle import margin

    V = z1.shape[-1]
    z1, zn, g1, gn = (t.reshape(-1, V) for t in (z1, zn, g1, gn))
    y = y1.reshape(-1)
    e1 = s1 = en = sn = dr = 0.0
    dz = 0.0
    # this side's error per vocab shard (TP's contiguous blocks): a far verdict names the rank
    # whose shard holds most of it
    blocks = world if world > 1 and V % world == 0 else 1
    eb = torch.zeros(blocks, dtype=torch.float64, device=z1.device)
    same = torch.equal(z1, zn)  # this side's logits the reference's: one softmax serves both
    rows = max(1, BLOCK // V)
    for a in range(0, z1.shape[0], rows):
        yy = y[a:a + rows]
        p1 = _ce_grad(z1[a:a + rows], yy)
        r1 = g1[a:a + rows].to(torch.float64)
        if not (torch.isfinite(p1).all() and torch.isfinite(r1).all()):
            return None
        w1 = _fit(r1, p1)
        o1 = w1 * p1
        rn = gn[a:a + rows].to(torch.float64)
        if not torch.isfinite(rn).all():
            return None
        pn = p1 if same else _ce_grad(zn[a:a + rows], yy)
        if not same:
            # a column masked (-inf) at both sides moved by nothing (bounds.unmasked); NaN: no number, inf
            za, zb = unmasked(z1[a:a + rows].to(torch.float64), zn[a:a + rows].to(torch.float64))
            moved_z = float((zb - za).abs().max())
            dz = max(dz, moved_z if moved_z == moved_z else float("inf"))
        # this side's weights are its own fit: a token's weight may be a function of the logits
        # (PPO's ratio exp(logp - old) moves by the logits' rounding, and by a vocab-parallel
        # log-softmax's even on equal logits; a clip bound may be crossed): what is judged is the
        # form within each row, where a one-rank vocab-shard mistake shows
        on = _fit(rn, pn) * pn
        dr += float((((rn - on) - (r1 - o1)) ** 2).sum())
        e1 += float(((r1 - o1) ** 2).sum())
        s1 += float((o1 * o1).sum())
        en += float(((rn - on) ** 2).sum())
        sn += float((on * on).sum())
        # which shard: the residual against the reference's weights (the own fit shares a shard's
        # error out over the row; a weight that moved with the logits only blurs this)
        dn = (rn - w1 * pn) ** 2
        eb += dn.reshape(dn.shape[0], blocks, -1).sum((0, 2))
    if not (s1 > 0 and sn > 0):
        return None
    ref_rel, err = (e1 / s1) ** 0.5, (en / sn) ** 0.5
    if ref_rel > FORM_ROUNDINGS * u:
        return None  # the reference's grad is no cross-entropy's: another loss form
    n = z1.numel()
    thr = margin(n) * max(ref_rel, u)
    # the residual's change: what the closed form leaves out is the same function at both sides
    moved, thr_moved = (dr / sn) ** 0.5, margin(n) * max(u, dz)
    share = (eb / max(float(eb.sum()), 1e-300)).tolist()
    far = err > thr or moved > thr_moved
    return {"far": far, "ratio": max(err / thr, moved / thr_moved), "ref_err": ref_rel, "err": err, "floor": u,
            "margin": margin(n), "threshold": thr, "relative": True, "n": n, "own": True,
            "blocks": blocks, "block_share": share, "residual_moved": moved, "residual_threshold": thr_moved,
            "logits_moved": dz,
            "what": "a cross-entropy's grad from the logits (each side's token weights its own fit)"
                    + (f", its rows' part off that form moved by {moved:.3g} of the grad from the reference's "
                       f"(a reordering moves it by at most {thr_moved:.3g})" if moved > thr_moved else "")}


def _fit(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Each row's weight w minimising ||r - w p|| (0 where p is 0), as a column."""
    pp = (p * p).sum(-1)
    return torch.where(pp > 0, (r * p).sum(-1) / pp.clamp_min(1e-300), torch.zeros_like(pp)).unsqueeze(-1)


def _ce_grad(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """softmax(z) - onehot(y) in float64; an ignored or out-of-range label has no one-hot."""
    p = torch.softmax(z.to(torch.float64), -1)
    ok = (y >= 0) & (y < z.shape[-1])
    rows = torch.nonzero(ok).squeeze(-1)
    p[rows, y[rows]] -= 1.0
    return p


def _worst_shard(v: dict) -> str:
    """', 99% of this side's error in rank 1's vocab shard,' where one shard holds most of it."""
    share = v.get("block_share") or []
    if len(share) < 2:
        return ""
    i = max(range(len(share)), key=share.__getitem__)
    if share[i] < 0.5:
        return ""
    return f", {share[i]:.0%} of this side's error in rank {i}'s vocab shard,"
