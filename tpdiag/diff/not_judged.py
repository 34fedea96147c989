"""The grads past the first divergence that no check judged, said in the verdict: activation grads
(grad_out) and weight grads (param_grad, _weight_grads).

Past the first divergence a grad_out record is judged against its one module consumer's float64
backward run on this side's own output grad (diff/oracle_own.py), plus the grad through a residual
add where a recorded grad explains it (diff/other_paths.py). A grad that leaves by anything else -
an output read only by code outside any module (`h = h * sigmoid(gate(h))` in the parent's forward:
the multiply's share of h's grad is no record), read by several unrelated modules (a tied weight's
users), or whose reference no recorded path explains - has no exact value to be judged against.
Such a grad was left silent: a replicated gate behind Megatron's f (its input grad TP times,
tests/models/planted/two_paths.py:gate_f) moved the block's output grad 3800% and read
`rounding only`. Each one is now listed with its reason (summary.json `not_judged`, one line in the
verdict), never passed over in silence."""
from __future__ import annotations

from tpdiag.diff import enclosing
from tpdiag.diff.measured_steps import measured_steps
from tpdiag.diff.moved_limit import EPS, moved_limit, rel_l2
from tpdiag.records.keys import sole_consumer

NO_MODULE = "read by code outside any module (no module consumer whose backward makes it)"
SEVERAL = "read by more than one module (their backwards together make it)"
# a few keys in summary.json; the count says how many
MAX_KEYS = 20


def grads(dd, first_key: str | None) -> dict | None:
    """{records, why: {reason: count}, keys, reasons: {key: its reason}, max_rel}: the divergent
    activation grads after the first divergence that neither a bound nor a float64 re-execution
    judged (each listed key with its own reason: joined into one line, two grads' reasons could not
    be told apart); None when none, or when this diff judged nothing on its own inputs (pass 1: the
    second pass's diff says it)."""
    if not (getattr(dd, "oracle_own", None) or getattr(dd, "grad_in_own", None)
            or getattr(dd, "oracle_own_norms", None)):
        return None
    first = next((r["idx"] for r in dd.rows if r["key"] == first_key), None)
    if first is None:
        return None
    left = []
    for r in dd.rows:
        if (r["phase"], r["kind"]) != ("backward", "grad_out") or r["idx"] <= first or r["bitwise"] \
                or r.get("rank_consistent") is False or r.get("oracle") or r.get("bound") is not None \
                or r.get("beyond_bound") or r.get("scale") is not None or r.get("nonfinite_mismatch"):
            continue
        consumers = [c for c in r.get("consumers") or () if isinstance(c, str)]
        if r.get("oracle_refused"):
            w = str(r["oracle_refused"])
        elif not consumers or sole_consumer(consumers) is None:
            # its enclosing module's float64 backward judges it (diff/enclosing.py) - where not, why
            w = (NO_MODULE if not consumers else SEVERAL) + "; " + (enclosing.why_not(dd, r) or "not judged")
        else:
            continue  # its one consumer was not re-executed on this side's inputs: own_inputs' choice
        left.append((r, w))
    left = _not_namesakes(dd, left)
    steps = measured_steps(dd.rows)
    left += _weight_grads(dd, first, steps)
    why: dict[str, int] = {}
    keys, reasons, worst, worst_l2 = [], {}, 0.0, None
    for r, w in left:
        why[w] = why.get(w, 0) + 1
        keys.append(r["key"])
        if len(reasons) < MAX_KEYS:
            reasons[r["key"]] = w
        rel = r.get("max_rel")
        if isinstance(rel, (int, float)) and rel == rel:
            worst = max(worst, float(rel))
        moved = rel_l2(dd.tensors.get(r["key"])) if str(r.get("step")) in steps else None
        if moved is not None:
            worst_l2 = max(worst_l2 or 0.0, moved)
    if not keys:
        return None
    out = {"records": len(keys), "why": why, "keys": keys[:MAX_KEYS], "reasons": reasons, "max_rel": worst}
    weights = sum(1 for r, _ in left if r["kind"] == "param_grad")
    if weights:
        out["weight_grads"] = weights  # the rest are activation grads (grads_words says which)
    if worst_l2 is not None:
        out["rel_l2"] = worst_l2
    listed = set(keys)
    dtypes = [r.get("dtype") for r in dd.rows if r["key"] in listed]
    coarse = max((d for d in dtypes if d in EPS), key=EPS.get, default=None)
    if coarse is not None:
        out["dtype"] = coarse  # the least precise: the limit's unit (moved_beyond)
    return out


WEIGHT = ("no check judged it: its module's backward was not re-executed in float64 (a module "
          "whose weight is used outside its own forward - a tied vocab weight's embed/logits methods - has no "
          "call to re-execute)")


def _weight_grads(dd, first: int, steps: set[str]) -> list:
    """The weight grads past the first divergence that no check judged (no float64 re-execution, bound or
    scale) and that moved beyond what rounding moves a record no check judged (moved_limit, in the least
    precise dtype the degree records: cut's rule, which the gate applies to every such record). A module
    whose weight the model reads through methods of its own (`vocab.embed(ids)`, `vocab.logits(h)`: a
    hand-written tied vocab-parallel embedding) is never called, so nothing re-executes its backward:
    tests/models/planted/tied_vocab.py:tied_dfn (the embedding's share of the tied grad TP times itself,
    the weight grad 0.55 of its norm off) read `rounding only` while the gate called the run edited
    after it. Listed only where they moved that far: within it, a weight grad is rounding by the same
    rule (no list of every unjudged weight grad of a correct run)."""
    rows = [r for r in dd.rows if (r["phase"], r["kind"]) == ("backward", "param_grad") and r["idx"] > first
            and not r["bitwise"] and r.get("rank_consistent") is not False and not _judged(r)
            and not r.get("beyond_bound") and not r.get("nonfinite_mismatch") and str(r.get("step")) in steps]
    if not rows:
        return []
    limit = moved_limit([r.get("dtype") for r in dd.rows])
    out = []
    for r in rows:
        moved = rel_l2(dd.tensors.get(r["key"]))
        if moved is not None and not moved <= limit:
            out.append((r, str(r.get("oracle_refused") or WEIGHT)))
    return out


def _not_namesakes(dd, left: list) -> list:
    """`left` without the grads that are, on both sides, the very bits of another activation grad of
    the step that is judged (not in `left`): one tensor recorded under two names (a parent returning
    its child's output: HF's LlamaModel returns model.norm's). Before RECORD_FORMAT 3 an HF CausalLM's
    root and its `model` child both recorded as "model", and their output grads - model.norm's and
    lm_head's, judged under those names - were listed as not judged on every hf: compare. A grad with
    no whole pair here (hash capture) stays listed."""
    if not left:
        return left
    listed = {r["key"] for r, _ in left}
    out = []
    for r, w in left:
        pair = dd.tensors.get(r["key"])
        if pair is None or not all(hasattr(t, "shape") for t in pair) or not _judged_twin(dd, r, pair, listed):
            out.append((r, w))
    return out


def _judged_twin(dd, r: dict, pair, listed: set) -> bool:
    import torch

    for o in dd.rows:
        # the twin's verdict must not be made from this very grad: a child returning its parent's
        # output (mlp.reduce in mlp) is judged by the parent's float64 backward FROM the parent's
        # output grad - the grad listed here, passed through unchanged (err 0). A stale backward memo
        # in the root's code (tests/models/planted/step_stale_grad.py) moved mlp's output grad by half
        # its norm at step 1, the grad was dropped as its child's namesake, and the bug read rounding
        if o["key"] in listed or (o["phase"], o["kind"]) != ("backward", "grad_out") or o["step"] != r["step"] \
                or o.get("rank_consistent") is False or not _judged(o) or _judged_from(dd, o, r["module"]):
            continue
        twin = dd.tensors.get(o["key"])
        if twin is None or not all(hasattr(t, "shape") for t in twin):
            continue
        if all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(pair, twin)):
            return True
    return False


def _judged(o: dict) -> bool:
    """A verdict held by the grad itself: a float64 re-execution, a bound or a scale (what keeps a
    grad out of `grads`' list as judged)."""
    return bool(o.get("oracle") or o.get("bound") is not None or o.get("scale") is not None)


def _judged_from(dd, o: dict, module: str) -> bool:
    """o (a grad_out no one module consumes) is judged by `module`'s float64 backward, which starts
    from `module`'s own output grad (diff/enclosing.py)."""
    consumers = [c for c in o.get("consumers") or () if isinstance(c, str)]
    return (not consumers or sole_consumer(consumers) is None) \
        and enclosing.judge_of(dd, o["module"], o["step"]) == module
