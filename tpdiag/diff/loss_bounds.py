"""The loss phase's bounds: the logprobs and the loss from the logits, the grad norm from the grads."""
from __future__ import annotations

import torch

from tpdiag.diff import bounds, pair_memo
from tpdiag.diff.engine import DegreeDiff
from tpdiag.records.keys import record_key


def _set(row: dict, bound: float, diff: float) -> None:
    row["bound"] = bound
    row["bound_ratio"] = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
    # not `diff > bound`: a NaN on either side is beyond, not within (fail closed)
    row["beyond_bound"] = not diff <= bound


def _logits_whole(rows: list[dict], lk: str) -> None:
    """Marks the loss row `logits_whole` where the loss read logits every rank held whole (every
    vocab entry: no shard to gather) and bitwise the reference's: no vocab-parallel softmax ran
    before it, so a loss that still differs was reduced over the ranks in the loss function's own
    code (diff/judge.py, "a loss from whole, equal logits")."""
    lg = next((r for r in rows if r["key"] == lk), None)
    if lg is None or lg.get("layout") != "replicate" or lg.get("bitwise") is not True \
            or lg.get("rank_consistent") is False:
        return
    for r in rows:
        if r["kind"] == "loss" and r["phase"] == "loss":
            r["logits_whole"] = True


def _loss_logprobs(dd: DegreeDiff, step: int, l1, ln, p1, pn) -> tuple:
    """The per-token log-probs the loss itself rounds, for its bound under a trainer's recipe.

    The loss is the cross-entropy of the logits at temperature 1 (runner/losses.default_loss), the
    recipe or not: each token's term is a float32 log-softmax l = z_y - lse(z), whose rounding
    bound is 2d + 2 gamma_V + 4u(1 + |l_1| + |l_N|) + u_out(|l_1| + |l_N|) (bounds.logprob_bound
    without a recipe). The recorded logprobs are the recipe's, lam = z_y/T - lse(z/T), and their
    tail grows as 1/T (a logit gap g below the max gives -g/T): put in that bound's |l| terms, they
    made the loss's bound ~1/T too loose at T < 1 (at T = 0.5 ~2x in those terms). Here l is taken
    in float64 from the recorded logits and labels (0 at an ignored label, as cross_entropy gives
    it); each side's float32 l is within O(u)|l| of it, which moves the terms by O(u^2). At T > 1
    the recipe's |lam| is the smaller: the bound was too tight there, and a correct loss could read
    beyond rounding. Without a labels record of the logits' rows, |l| <= lse(z) - min(z) of each
    row stands in (any label's; only the terms' size is used, never their sign)."""
    v = l1.shape[-1]
    y = _labels(dd, step)
    if y is not None and (y.is_floating_point() or y.numel() * v != l1.numel()):
        y = None
    out = []
    for z, p in ((l1, p1), (ln, pn)):
        z = z.reshape(-1, v)
        lp = torch.empty(z.shape[0], dtype=torch.float64, device=z.device)
        lab = y.to(z.device) if y is not None else None
        keep = ((lab >= 0) & (lab < v)) if lab is not None else None  # an ignored label (-100): no term
        rows = max(1, (1 << 20) // max(v, 1))  # a few rows at a time, as logprob_bound
        for i in range(0, z.shape[0], rows):
            x = z[i:i + rows].double()
            lse = x.logsumexp(-1)
            if lab is None:  # no label: |l| <= lse(z) - min(z) for any label of the row
                # min over the finite logits: a masked column (-inf) is no label's
                lp[i:i + rows] = lse - torch.where(torch.isfinite(x), x, torch.full_like(x, float("inf"))).amin(-1)
            else:
                ids = torch.where(keep[i:i + rows], lab[i:i + rows], 0)[:, None]
                lp[i:i + rows] = torch.where(keep[i:i + rows], lse - x.gather(-1, ids)[:, 0], 0.0)
        # in the recorded logprobs' dtype: their own rounding's unit is the bound's u_out
        out.append(lp.to(p.dtype).reshape(p.shape))
    return tuple(out)


def _labels(dd: DegreeDiff, step: int):
    """The batch's labels record of this step (or step 0's: one batch for every step), if any."""
    yk = next((k for k in (record_key(step, "init", "model", "batch", 0, "labels"),
                           record_key(0, "init", "model", "batch", 0, "labels")) if k in dd.tensors), None)
    return dd.tensors[yk][0].reshape(-1) if yk is not None else None


def _counted(dd: DegreeDiff, step: int, el: torch.Tensor) -> torch.Tensor:
    """The per-token bounds of the tokens the loss counts. A cross-entropy with ignored labels is
    the mean over the counted tokens only: its difference is at most THEIR bounds' mean. The mean
    over every position put the ignored positions' bounds in - smaller where those rows' logits
    agree (a padded row both sides compute alike) - and could read a correct loss beyond it; a loss
    that divides by every position instead is within this too (its sum is the same, its divisor
    larger). No labels record, or another shape: every position, as before."""
    y = _labels(dd, step)
    if y is None or y.is_floating_point() or y.numel() != el.numel():
        return el
    keep = (y >= 0).to(el.device).reshape(el.shape)
    return el[keep] if bool(keep.any()) else el


def loss_bounds(dd: DegreeDiff) -> None:
    """Bounds for the logprobs and the loss (from the logits) and for the grad norm (from the
    grads): a loss that is wrong at TP > 1 (a log(TP) offset, a local vocab size) is a finding,
    not a 'vocab-parallel-softmax' reordering. Assumes a cross-entropy-like loss."""
    by_step: dict = {}
    for row in dd.rows:
        by_step.setdefault(row["step"], []).append(row)
    for step, rows in by_step.items():
        lk = record_key(step, "loss", "model", "logits", 0, "logits")
        _logits_whole(rows, lk)
        lp_row = next((r for r in rows if r["kind"] == "logprobs"), None)
        if lk in dd.tensors and lp_row is not None and lp_row["key"] in dd.tensors:
            (l1, ln), (p1, pn) = dd.tensors[lk], dd.tensors[lp_row["key"]]
            if l1.shape == ln.shape and p1.numel() == l1.numel() // l1.shape[-1]:
                loss_row = next((r for r in rows if r["kind"] == "loss"), None)
                if loss_row is not None and loss_row["key"] not in dd.tensors:
                    loss_row = None

                def measure():
                    # the logprobs are the trainer's recipe (--logprob); the loss is the cross-entropy's
                    eb = bounds.logprob_bound(l1, ln, p1, pn, dd.recipe)
                    chk = bounds.check(p1.reshape(-1), pn.reshape(-1), eb)
                    lp = chk.bound, chk.diff, chk.ratio, chk.beyond
                    if loss_row is None:
                        return lp, None
                    # the loss's own per-token log-probs (temperature 1), not the recipe's: their
                    # size is in both the float32 bound and a 16-bit loss's own rounding below
                    q1, qn = _loss_logprobs(dd, step, l1, ln, p1, pn) if dd.recipe else (p1, pn)
                    if dd.recipe:
                        eb = bounds.logprob_bound(l1, ln, q1, qn)
                    la, lb = dd.tensors[loss_row["key"]]
                    a, b = (float(t.double().reshape(-1)[0]) for t in (la, lb))
                    # a 16-bit loss (a Target.loss's cross_entropy on bf16 logits; the default loss
                    # is float32, runner/losses.default_loss) rounds each token's log-softmax to its
                    # dtype before the mean, where the logprobs record is float32: that rounding is
                    # the loss's own, per element
                    el = eb
                    if la.dtype in (torch.bfloat16, torch.float16) and p1.dtype != la.dtype:
                        el = eb + bounds.UNIT_ROUNDOFF[la.dtype] * (
                            q1.reshape(-1).double().abs() + qn.reshape(-1).double().abs()).to(eb.dtype)
                    # a token no rounding explains (logprob_bound's 0: a column masked at one side only,
                    # a NaN) has no share of a mean's rounding: counted, the loss's bound is 0
                    el = _counted(dd, step, torch.where(eb > 0, el, torch.zeros_like(el)))
                    bound = bounds.mean_bound(el, a, b, p1.numel(), la.dtype) if bool((el > 0).all()) else 0.0
                    return lp, (bound, 0.0 if a == b else abs(b - a))

                # the same records' bounds, measured earlier in this process (diff/pair_memo.py)
                ids = pair_memo.of(dd, lk, lp_row["key"], *((loss_row["key"],) if loss_row else ()))
                lp, loss = pair_memo.cached(ids and ("logprob", bounds.logprob_bound, bounds.check,
                                                     bounds.mean_bound, ids, tuple(sorted(dd.recipe.items()))),
                                            measure)
                _set(lp_row, lp[0], lp[1])
                lp_row["bound_ratio"], lp_row["beyond_bound"] = lp[2], lp[3]
                if loss is not None:
                    _set(loss_row, *loss)
                    if loss_row["beyond_bound"]:
                        from tpdiag.diff.scale import whole_factor

                        la, lb = dd.tensors[loss_row["key"]]
                        c = whole_factor(float(la.double().reshape(-1)[0]), float(lb.double().reshape(-1)[0]),
                                         loss[0])
                        if c is not None:
                            loss_row["loss_factor"] = c
        if dd.captured:
            from tpdiag.diff.loss_first_order import first_order_bound

            first_order_bound(dd, step, rows)  # a user's own loss: no logprobs records, no code to re-run
        from tpdiag.diff.loss_first_order import grad_bound

        # the logits' grad of a user's loss (compare: Target.loss; a capture: its own loss)
        grad_bound(dd, rows)
        gn = next((r for r in rows if r["kind"] == "grad_norm"), None)
        if gn is not None and gn["key"] in dd.tensors:
            grads = [r["key"] for r in rows if r["kind"] == "param_grad"]
            # every grad the norm read, or no bound: hash capture keeps whole values only for the
            # first divergence, and a triangle bound over some of the grads is too small - it
            # called a grad norm over rounding-different grads a bug (llama-1b, micro-batch 8 vs 1)
            pairs = [dd.tensors[k] for k in grads if k in dd.tensors] if all(k in dd.tensors for k in grads) else []
            if pairs and all(a.shape == b.shape for a, b in pairs):
                a, b = (float(t.double().reshape(-1)[0]) for t in dd.tensors[gn["key"]])
                g1, gn_ = [p[0] for p in pairs], [p[1] for p in pairs]
                # the same records' bound, measured earlier in this process (diff/pair_memo.py);
                # beyond the triangle bound but faithful to its own grads: the bound's rounding
                # model was too tight (a GPU's serial reduce runs), not a wrong norm
                ids = pair_memo.of(dd, gn["key"], *grads)
                def norms():
                    # each grad pair read once for both (bounds.grad_sums), not once per sum
                    sums = bounds.grad_sums(g1, gn_)
                    return bounds.norm_bound(g1, gn_, a, b, sums), bounds.norm_own_errors(g1, gn_, a, b, sums)

                bound, own = pair_memo.cached(
                    ids and ("norm", bounds.norm_bound, bounds.norm_own_errors, ids), norms)
                _set(gn, bound, abs(b - a))
                gn["norm_own"] = own
                if gn["beyond_bound"] and not own["far"]:
                    gn["beyond_bound"] = False
