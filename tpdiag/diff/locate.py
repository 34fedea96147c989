"""Find the first divergence, name its cause, and list every finding (beyond bound / inconsistent).

Rule: walking records in execution order, the first record that differs from the reference is
the root cause - every record it consumed came earlier and was bitwise equal. Its cause is read
from its layout and op kind, and from its size against a rounding bound.
"""
from __future__ import annotations

import torch

from tpdiag.diff import anchored, bits, bounds, generic_bound, loss_grad, on_device, oracle, oracle_own, pair_memo, partials, rank_partials, router
from tpdiag.diff.loss_bounds import loss_bounds
from tpdiag.diff.judge import CALLER_FAR, EMBED_CLASSES, NORM_CLASSES, Evidence, baseline_cause, describe, judge, settle  # noqa: F401
from tpdiag.diff.op_verdict import op_verdict
from tpdiag.diff.engine import DegreeDiff
from tpdiag.diff.first_op import _caller_op, _caller_verdict, _first_op, _pick_source_equal
from tpdiag.records.keys import ROOTS, record_key
from tpdiag.records.scored import scored_mask
from tpdiag.records.ops import ATTENTION_OPS, COLLECTIVE_OPS, PICK_OPS, is_op_of  # noqa: F401

from tpdiag.records.causes import CAUSES  # noqa: F401  (the labels live with the record format)


def attention_op(op: str | None) -> bool:
    return is_op_of(op, ATTENTION_OPS)


LINEAR_CLASSES = ("Linear",)


def _param_key(step: int, module: str, name: str) -> str:
    if step == 0:
        return record_key(0, "init", module, "param_init", 0, name)
    return record_key(step - 1, "optimizer", module, "param", 0, name)


def add_bounds(dd: DegreeDiff, world: int) -> None:
    """Attach a rounding bound to every Linear forward output (the ops where a bug would hide)."""
    dd.world = world
    params = {r["key"]: r for r in dd.rows if r["kind"] in ("param_init", "param")}
    for row in dd.rows:
        if row["phase"] != "forward" or row["kind"] != "out" or row["cls"] not in LINEAR_CLASSES:
            continue
        k = row["key"]
        xk = record_key(row["step"], "forward", row["module"], "in", row["call"], 0)
        wk = _param_key(row["step"], row["module"], "weight")
        bk = _param_key(row["step"], row["module"], "bias")
        if k not in dd.tensors or xk not in dd.tensors or wk not in dd.tensors:
            continue
        y1, yn = dd.tensors[k]
        x1, xn = dd.tensors[xk]
        # the weights as the step's forward read them (a re-anchored step: the reference's at both sides)
        w1, wn = anchored.read_pair(dd, wk, row["step"])
        b1, bn = anchored.read_pair(dd, bk, row["step"]) or (None, None)
        if x1.shape[-1] != w1.shape[-1] or y1.shape != yn.shape:
            continue
        if (xn.shape != x1.shape or wn.shape != w1.shape or x1.shape[:-1] != y1.shape[:-1]
                or w1.shape[0] != y1.shape[-1]):
            continue  # not whole tensors (e.g. stacked shards of two same-degree TP>1 worlds)
        def measure():
            def work(x1, xn, w1, wn, y1, yn, b1, bn):
                b = bounds.linear_bound(x1, xn, w1, wn, y1, yn, world, b1, bn)
                if b.shape != y1.shape:
                    return ()
                chk = bounds.check(y1, yn, b)
                return chk.bound, chk.ratio, chk.beyond

            # its float64 GEMMs on the parent's check device where it has one (diff/on_device.py)
            return on_device.run(work, x1, xn, w1, wn, y1, yn, b1, bn)

        # the same records' bound, measured earlier in this process (diff/pair_memo.py)
        ids = pair_memo.of(dd, k, xk, wk, *((bk,) if b1 is not None else ()))
        got = pair_memo.cached(ids and ("linear", bounds.linear_bound, bounds.check, world, ids), measure)
        if not got:
            continue
        row["bound"], row["bound_ratio"], row["beyond_bound"] = got
        if not row["bitwise"] and rank_partials.reduces_over_ranks(params.get(wk)):
            # the oracle's floor for a sum of rounded rank partials: THIS side's (diff/rank_partials.py)
            p = rank_partials.partials_norm(xn, wn, world)
            if p is not None:
                row["rank_partials_norm"] = p
    generic_bound.add_generic_bounds(dd, world)  # modules with no layout: from their own records
    oracle.apply(dd)  # any module or op the reference re-executed in float64: bug or rounding
    oracle_own.apply_own(dd)  # ... and past the first divergence, from this side's own inputs
    for row in dd.rows:
        if row.get("oracle") and not row.get("beyond_bound") and not row.get("oracle_flip") \
                and row["kind"] == "out" and not row.get("generic_cause"):
            cause, why = generic_bound.reorder_cause(dd, row, None)
            row["generic_cause"] = cause
            if why:
                row["cause_why"] = why
            else:
                row.pop("cause_why", None)
        elif row.get("oracle") and not row.get("beyond_bound") and row["kind"] == "grad_out" \
                and classify(row) == "unknown":
            # near its consumer's float64 backward: a dgrad summed over output shards
            row["generic_cause"] = "column-parallel-dgrad"
        elif row.get("oracle") and not row.get("beyond_bound") and row["kind"] == "param_grad":
            # near its float64 backward: the weight grad's sum over tokens (a GEMM), reordered by
            # another shape, or summed over ranks by a hand-written all-reduce
            reducing = any(generic_bound._is_reducing(r["name"]) for r in dd.uncompared
                           if r.get("kind") == "op" and r.get("step") == row["step"]
                           and r.get("phase") == "backward")
            if _partial_grad_out(dd, row):
                # its output grad was each rank's share of a sum over sharded heads (MLA's rope
                # columns: k_rot expanded over the heads, all-reduced by the mla_kv_a_proj style's
                # backward): TP=1 sums every head in one reduction, TP=N adds N rounded partials.
                # A replicated Linear runs the same GEMM shapes at every degree, so no GEMM is at fault
                row["generic_cause"] = "column-parallel-dgrad"
                row["partial_grad_out"] = True
            else:
                row["generic_cause"] = "row-parallel-reduction" if reducing else "shape-dependent-gemm"
    loss_bounds(dd)
    # the logits' grad: a user's own loss backward, judged against a cross-entropy's float64 grad
    loss_grad.judge_logits_grad(dd, world)
    on_device.release()
    # NaN/Inf where the reference has a finite value (or the reverse) is no rounding: a wrong
    # result. Its first appearance is the finding; everything after merely inherits it.
    first_nonfinite = next((r for r in dd.rows if r.get("nonfinite_mismatch")), None)
    if first_nonfinite is not None:
        first_nonfinite["beyond_bound"] = True
        first_nonfinite["bound_ratio"] = float("inf")


def _partial_grad_out(dd, row: dict) -> bool:
    """Was this module's output grad left uncompared as an unreduced partial (each rank's share,
    reduced later in the backward by the module's own style: diff/engine.py)?"""
    return any(u.get("module") == row["module"] and u.get("kind") == "grad_out" and u.get("step") == row["step"]
               and partials.unreduced(u) for u in getattr(dd, "uncompared", ()) or ())


def nonfinite_summary(rows: list[dict]) -> dict | None:
    """Which records hold NaN or Inf (at one side or both: `side`), and the first of them (execution order)."""
    nf = [r for r in rows if r.get("nonfinite_mismatch")]
    if not nf:
        return None
    f = nf[0]
    return {"records": len(nf), "nan_records": sum(r.get("nonfinite") == "NaN" for r in nf),
            "first": {k: f.get(k) for k in ("key", "phase", "module", "kind", "name", "step")}
            | {"value": (f.get("nonfinite") or "NaN or Inf").lower(), "side": f.get("nonfinite_side") or "degree"}}  # "nan": JSON's "NaN" reads back as a float


def classify(row: dict) -> str:
    """The cause a record's own row names (its bits, ranks, bound and layout), before any
    evidence about its op or its configuration: the judge's record rules (diff/judge.py)."""
    return judge(Evidence(row=row, record=row)).cause


def _caller(module: str, called: set) -> str:
    """The module whose code computed an input of `module`: its nearest ancestor that was called
    (has forward records) - a ModuleList or ModuleDict holds children but never runs them."""
    parent = module.rpartition(".")[0]
    while parent and parent not in called:
        parent = parent.rpartition(".")[0]
    if parent:
        return parent
    from tpdiag.records.keys import root_of

    return root_of(called)


def _describe(row: dict, called: set = frozenset()) -> dict:
    out = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
           "name": row["name"], "step": row["step"], "key": row["key"], "idx": row["idx"],
           "cause": None, "root_cause": True,
           "max_abs": row["max_abs"], "max_ulp": row["max_ulp"],
           "mismatch_fraction": row["mismatch_fraction"], "bound": row.get("bound"),
           "bound_ratio": row.get("bound_ratio"),
           "style": row.get("style")}
    _explain(out, row)
    out = describe(row, out)
    if row["kind"] == "grad_out" and row.get("consumers"):
        out["consumers"] = list(row["consumers"])  # whose backward made it (the second pass's oracle)
    if row.get("enclosing"):
        out["enclosing"] = row["enclosing"]  # the module whose float64 backward judged it (diff/enclosing.py)
    if row["kind"] == "in":
        parent = _caller(row["module"], called)
        out["module"] = parent
        out["detail"] = (f"the input of {row['module']} differs although every earlier record was "
                         f"bitwise equal: the first difference is in unprobed code of {parent}")
    elif row.get("partial_grad_out"):
        out["partial_grad_out"] = True
        out["detail"] = ("its input was bitwise equal; its output grad was each rank's share of a sum over the "
                         "heads TP shards (MLA's rope columns, all-reduced by the mla_kv_a_proj style's own "
                         "backward) - TP=1 sums every head in one reduction, so the reduced grad and the weight "
                         "grad from it differ by rounding; no fix in the catalogue reorders that sum")
    elif row["bitwise"] and row.get("rank_consistent") is False:
        # rank 0's copy matches the reference; the other ranks' copies of the replica do not
        out["detail"] = "every input it consumed was bitwise equal; its ranks' copies of it are not"
    else:
        out["detail"] = "every input it consumed was bitwise equal; its output is not"
    if row.get("rank_consistent") is False and row.get("rank_max_abs") is not None:
        out["rank_max_abs"] = row["rank_max_abs"]  # the spread between ranks (max_abs is vs the reference)
    return out


def _explain(out: dict, row: dict) -> None:
    if row.get("bound_model"):
        out["bound_model"] = row["bound_model"]
    if row.get("oracle"):
        out["oracle"] = row["oracle"]


def _partial_detail(f: dict, row: dict, earlier: list[dict]) -> None:
    """Say what a rank-inconsistent replica is when its ranks' copies sum to the reference
    (diff/partials.partial_sum), and point the replicas it desynchronised later in that step to it."""
    ps = row.get("rank_partial_sum")
    if ps is not None:
        f["partial_sum"] = True
        f["key"] = row["key"]
        f["detail"] = (f"the ranks' copies of this replica add up to the reference's value (the sum "
                       f"is off by {ps['sum_max_abs']:.2e}, a single copy by up to "
                       f"{ps['copy_max_abs']:.2e}): each rank holds its own partial sum and the plan "
                       "never all-reduces it")
        return
    if f["cause"] != "rank-inconsistent-replica" or f["phase"] != "optimizer":
        return  # the optimizer step reads every grad; a backward record does not read grads
    root = next((e for e in earlier if e.get("partial_sum") and e["step"] == f["step"]), None)
    if root is not None:
        f["after"] = root["key"]
        f["detail"] = (f"follows the never-reduced partial {root['kind']} of {root['module']} "
                       f"({root['name']}): the ranks stepped from different values")


def locate(dd: DegreeDiff, style_of_module: dict[str, str | None]) -> dict:
    for row in dd.rows:
        if row["kind"] == "grad_out":
            row["consumer_styles"] = [style_of_module.get(c) for c in (row.get("consumers") or [])]
    diverged = [r for r in dd.rows if not r["bitwise"] or r.get("rank_consistent") is False]
    first = next((r for r in diverged if r["kind"] != "op"), None) or next(iter(diverged), None)
    called = {r["module"] for r in dd.rows if r["phase"] == "forward" and r["kind"] == "out"}
    op_row = _first_op(dd, first) if first is not None and first["kind"] != "op" else None
    if op_row is None and first is not None and first["kind"] == "in" and first["phase"] == "forward":
        op_row = _caller_op(dd, first, _caller(first["module"], called))
    findings, fidx = [], []
    for r in dd.rows:
        if r.get("beyond_bound") or r.get("rank_consistent") is False or r.get("scale") is not None \
                or (r.get("oracle_flip") and (first is None or r["idx"] != first["idx"])):
            # a far float64 verdict with a choice inside that may have flipped shows neither rounding
            # nor a bug: a finding of its own (cause unknown unless a router flip explains it), never
            # passed over - a bug inside a top-k MoE past the first divergence read `rounding only`
            # (tests/models/planted/moe_late_bug.py), and so did a wrong grad out of one's backward
            # (moe_bwd_bug.py) before its float64 backward was shown to follow the runs' choices
            fidx.append(r["idx"])
            f = {"phase": r["phase"], "module": r["module"], "op": None, "kind": r["kind"],
                 "name": r["name"], "step": r["step"], "cause": None,
                 "max_abs": r.get("rank_max_abs", r["max_abs"]) if r.get("rank_consistent") is False
                 else r["max_abs"], "bound": r.get("bound"), "bound_ratio": r.get("bound_ratio")}
            _explain(f, r)
            if r.get("narrowed"):
                f["narrowed"] = r["narrowed"]
            if r.get("far_scale") is not None:
                f["far_scale"] = r["far_scale"]  # one factor: said beside the float64 verdict (cli/render.py)
            f = describe(r, f)
            if r.get("enclosing"):
                f["enclosing"] = r["enclosing"]  # the module whose float64 backward judged it
            if r["kind"] == "grad_out" and r.get("consumers"):
                f["consumers"] = list(r["consumers"])  # whose backward made it: where the user looks
            elif r["kind"] == "in" and r["phase"] == "forward":
                f["made_in"] = _caller(r["module"], called)  # whose own code computed the input
            _partial_detail(f, r, findings)
            roots = [g for g in findings if "follows" not in g]
            inner = [g for g in roots if _inside(g["module"], r["module"])]
            same = [g for g in roots if g["module"] == r["module"] and g["step"] == r["step"]
                    and not g.get("partial_sum")]
            if inner and r["kind"] == "out":
                # a parent's output carries its child's finding
                f["follows"] = inner[-1].get("key") or inner[-1]["name"]
            elif same and not r.get("rank_partial_sum"):
                # one module's mistake shows in its forward and its backward (a rescaled output
                # rescales its weight grad): one root per module, the rest grouped under it
                f["follows"] = same[0].get("key") or same[0]["name"]
            elif roots and not _is_root(dd, r, first):
                # a consequence: its inputs already differed from a finding before it
                f["follows"] = roots[-1].get("key") or roots[-1]["name"]
            f.setdefault("key", r["key"])
            findings.append(f)
    fd = _describe(first, called) if first else None
    flips = router.analyse(dd, fd)
    if flips:
        router.relabel_after(findings, fidx, flips, dd)
        order = sorted(range(len(findings) + len(flips)),
                       key=lambda j: fidx[j] if j < len(findings) else flips[j - len(findings)]["idx"])
        both = findings + flips
        findings = [both[j] for j in order]
    if fd is not None and op_row is not None:
        fd["op"] = op_row["name"].rsplit("#", 1)[0]
        fd["op_record"] = op_row["key"]
        if op_row.get("at"):
            fd["op_at"] = op_row["at"]
        if "why" in op_row:
            # every op the reference also ran was bitwise equal up to here: the difference
            # enters through an op that exists only at this degree (a collective)
            fd["op_detail"] = (f"{fd['op']} ({op_row['why']}); every op shared with the reference "
                               "before it was bitwise equal")
        else:
            fd["op_max_abs"] = op_row["max_abs"]
    elif fd is not None and first["kind"] == "op":
        fd["op"] = first["name"].rsplit("#", 1)[0]
        if first.get("at"):
            fd["op_at"] = first["at"]
        op_row = first
    if fd is not None:
        # the first divergent op, and its float64 re-execution where it judges what the module
        # record could not (an input that differs: the op is in the parent's own code)
        judges = op_row is not None and op_row.get("oracle") and (first["kind"] != "out" or not first.get("oracle"))
        cv = _caller_verdict(dd, first, fd)
        v = settle(fd, op=fd["op"], op_oracle=op_verdict(fd, op_row) if judges else None,
                   source_equal=_pick_source_equal(dd, op_row), caller_oracle=cv)
        far = (cv or {}).get("far_op")
        if v.rule == CALLER_FAR and far and far["record"] != fd.get("op_record"):
            # the bug is judged from the caller's inputs; where its code goes wrong is this op, not
            # the first op that differs (a reordering before it): the table and verdict line name it
            fd["bug_op"] = {**far, "caller_ratio": cv["ratio"]}
    return {"first_divergence": fd, "findings": findings}


def _inside(child: str, parent: str) -> bool:
    return child != parent and (parent in ROOTS or child.startswith(parent + "."))


def _is_root(dd: DegreeDiff, r: dict, first: dict | None) -> bool:
    """A finding that no earlier difference explains: the first divergence, a module output
    whose inputs and parameters were all bitwise equal, a never-reduced partial, an init record."""
    if first is not None and r["idx"] == first["idx"]:
        return True
    if r["phase"] == "init" or r.get("rank_partial_sum"):
        return True
    if (r.get("oracle") or {}).get("own") and (r.get("beyond_bound") or r.get("oracle_flip")):
        # wrong (or far, with a choice that may have flipped) from the very inputs it was given: no
        # earlier difference explains it
        return True
    return r["phase"] == "forward" and r["kind"] == "out" and oracle.inputs_equal(dd, r)


def logprob_stats(dd: DegreeDiff) -> dict | None:
    key = next((r["key"] for r in dd.rows if r["kind"] == "logprobs" and r["step"] == 0), None)
    lab = next((r["key"] for r in dd.rows if r["kind"] == "batch" and r["name"] == "labels"), None)
    if key is None or key not in dd.tensors:
        return None
    a, b = dd.tensors[key]
    bitwise = bits.bitwise_equal(a, b)
    a, b = a.to(torch.float64).flatten(), b.to(torch.float64).flatten()
    mask = scored_mask(dd.tensors[lab][0], a) if lab in dd.tensors else None
    if mask is None:
        mask = torch.ones_like(a, dtype=torch.bool)
    d = (b - a).abs()[mask]
    return {"bitwise": bitwise, "max_abs": float(d.max()) if d.numel() else 0.0,
            "mean_abs": float(d.mean()) if d.numel() else 0.0,
            "token_mult_prob_error": float(torch.exp(d).mean()) if d.numel() else 1.0,
            "tokens": int(mask.sum())}
