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
from tpdiag.records.keys import sole_consumer

NO_MODULE = "read by code outside any module (no module consumer whose backward makes it)"
SEVERAL = "read by more than one module (their backwards together make it)"
# a few keys in summary.json; the count says how many
MAX_KEYS = 20


def first_step(rows: list[dict]):
    """The step of the first record that differs: the one step whose unjudged grads rel_l2 measures.
    From it on the weights the optimizer updated differ too, and a correct model's grads move by far
    more than rounding moves one step: llama-1b bf16 --tp 1,2 --steps 3 on 2x H200 (Adam's first
    update is about lr * sign(grad), so a grad's near-zero elements rounded to the other sign move
    their weights 2 lr apart) listed grads 2.9 of their norm off and read "not judged" (gate 1)."""
    return next((r.get("step") for r in sorted(rows, key=lambda r: r["idx"]) if not r["bitwise"]), None)


# a later step's forward may move this many times the first differing step's own forward move and its
# weights still count as the reference's up to rounding (oracle.MARGIN): tiny-llama --steps 3, correct,
# moved its forward records 5.0e-7 at step 0 and 4.7e-5 at step 1 in float32 (94x: Adam's sign-like
# update), 0.0094 and 0.14 in bfloat16 (15x) - those steps stay unmeasured, as the first_step rule had it
DRIFT_MARGIN = 8.0
# ... and only where the first step's forward moved as rounding moves it (1.2 eps of float32 in the
# planted step_stale_grad.py, 1.2 eps of bfloat16 in tiny-llama), not by a flipped near tie's O(1)
BASE_ROUNDINGS = 64


def measured_steps(rows: list[dict]) -> set[str]:
    """The steps whose unjudged grads rel_l2 measures: the first differing one (first_step), and a
    later one whose forward records moved no more than DRIFT_MARGIN times the first step's did - its
    weights not moved apart by the updates, so a grad of it that moved far moved by the step's own
    code. A backward memo keyed too loosely (tests/models/planted/step_stale_grad.py:stale_grad_drop)
    moved mlp's output grad half its norm at step 1 of a float32 run whose forward stayed at 1.5e-7,
    and read rounding only with the first step alone measured."""
    first = first_step(rows)
    if first is None:
        return set()
    moved: dict[str, float] = {}
    eps = []
    for r in rows:
        if r["phase"] == "forward" and r["kind"] in ("in", "out") and not r["bitwise"]:
            v = r.get("rel_l2")
            v = float("inf") if not isinstance(v, float) or v != v else v
            moved[str(r.get("step"))] = max(moved.get(str(r.get("step")), 0.0), v)
            if str(r.get("step")) == str(first):
                eps.append(EPS.get(str(r.get("dtype") or "").replace("torch.", ""), EPS["bfloat16"]))
    base = moved.get(str(first), 0.0)
    if base > BASE_ROUNDINGS * max(eps or [EPS["bfloat16"]]):
        # its move not measured (no tensors), or past a few roundings (a discrete choice flipped by
        # rounding moves what follows it by O(1)): no scale for the later steps' drift
        return {str(first)}
    steps = {str(r.get("step")) for r in rows}
    return {str(first)} | {s for s in steps if moved.get(s, 0.0) <= DRIFT_MARGIN * base}


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
        moved = _rel_l2(dd.tensors.get(r["key"])) if str(r.get("step")) in steps else None
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


def _split(nj: dict) -> tuple:
    """(records, activation grads, weight grads) summary.json not_judged lists; the last two None where
    the split is unknown (fewer keys listed than records, no valid `weight_grads`). A summary without
    `weight_grads` counts the param_grad keys it lists."""
    from tpdiag.records.keys import MalformedKey, RecordKey

    n = nj.get("records")
    keys = [k for k in nj.get("keys") or () if isinstance(k, str)]
    n = n if isinstance(n, int) and not isinstance(n, bool) else len(keys)
    w = nj.get("weight_grads")
    if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w <= n:
        if len(keys) < n:
            return n, None, None
        w = 0
        for k in keys:
            try:
                w += RecordKey.parse(k).kind == "param_grad"
            except MalformedKey:
                pass
    return n, n - w, w


def grads_words(nj: dict) -> str:
    """How many grads summary.json not_judged lists, and of which kind: '3 activation grads', '1 weight
    grad', '2 activation grads and 1 weight grad' (a weight's grad was called an activation grad);
    'N grads' where the split is unknown."""
    n, a, w = _split(nj)
    if a is None:
        return f"{n} grad{'s' if n != 1 else ''}"
    parts = [f"{a} activation grad{'s' if a != 1 else ''}" if a else "",
             f"{w} weight grad{'s' if w != 1 else ''}" if w else ""]
    return " and ".join(p for p in parts if p) or f"{n} grads"


def grads_kind(nj: dict) -> str:
    """The kind of the grads summary.json not_judged lists, no count: 'activation grads', 'weight grads',
    'activation and weight grads', 'grads' where it is unknown."""
    _, a, w = _split(nj)
    if not a and not w:
        return "grads"
    return "activation and weight grads" if a and w else "weight grads" if w else "activation grads"


def grad_words(key: str) -> str:
    """A listed record in words: 'weight grad of out_scale' for a param_grad record (the parameter's
    name in the model), else 'activation grad'; '' for a key that does not parse."""
    from tpdiag.records.keys import MalformedKey, RecordKey, param_name

    try:
        k = RecordKey.parse(key)
    except MalformedKey:
        return ""
    if k.kind == "param_grad" and k.name:
        return f"weight grad of {param_name(k.module, k.name)}"
    return "activation grad"


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
        moved = _rel_l2(dd.tensors.get(r["key"]))
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


# How far (relative 2-norm), in roundings of the grads' dtype, an activation grad no check judged may
# move and still be called rounding (compare's class, and so the gate: it is the same rule). Rounding
# moved the built-in tiny-llama's by ~20 eps (float32: 2.5e-6, two micro-batches, two steps; bfloat16:
# 0.0987 = 13 eps at TP=4, two steps - near 0.1, so no fixed number serves every dtype); a grad made
# twice (Megatron's f in front of a replicated module) moves by ~1. In bfloat16 1000 eps is 7.8 (float16:
# 0.98) - no limit at all: a bf16 two_paths:pair_f, its block's grad a quarter off (0.251) while no
# check judged it, read rounding and passed `gate --allow rounding`. So the limit is also at most
# NOT_JUDGED_MAX_REL of the grad's norm in any dtype: twice the most rounding moved a correct model's
# unjudged grads (0.0987, bf16; llama 8B and a 70B slice on H200, bf16: 0.081, 0.034 - docs/scale.md),
# and below a doubled share of a grad. A bug that moves an unjudged grad by less than that in bf16
# still reads rounding (docs/causes.md, Not covered). After a router flip (rounding-class, discrete)
# grads move by O(1) with no bug: not applied there.
NOT_JUDGED_ROUNDINGS = 1000
NOT_JUDGED_MAX_REL = 0.2
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def moved_limit(dtypes) -> float:
    """How far (relative 2-norm) rounding may move a record no check judged: NOT_JUDGED_ROUNDINGS eps of
    the least precise of `dtypes` (names, "torch." or not; none known: bfloat16's), at most
    NOT_JUDGED_MAX_REL - the one limit of moved_beyond, cut and dropped_hooks._not_idle."""
    eps = [EPS[d] for d in (str(d).replace("torch.", "") for d in dtypes) if d in EPS]
    return min(NOT_JUDGED_ROUNDINGS * max(eps or [EPS["bfloat16"]]), NOT_JUDGED_MAX_REL)


def moved_beyond(entry: dict, dtypes: list | None = None) -> tuple[float, float] | None:
    """(how far the unjudged grads moved, the limit) where they moved beyond NOT_JUDGED_ROUNDINGS eps
    of the least precise of `dtypes` (the listed records' dtypes; None: summary.json's own word, then
    bfloat16's) or beyond NOT_JUDGED_MAX_REL, else None. Such a degree is not judged (class unknown,
    diff/classes.py) and the gate fails it as cause unknown (gate/verdict.py) - one rule, so compare
    never says "nothing is wrong" where the gate fails the run."""
    nj = entry.get("not_judged")
    moved = nj.get("rel_l2") if isinstance(nj, dict) else None
    if not isinstance(moved, (int, float)) or isinstance(moved, bool):
        return None
    found = [f for f in [entry.get("first_divergence"), *(entry.get("findings") or ())] if isinstance(f, dict)]
    if any(f.get("cause") == "router-flip" for f in found):
        # a discrete choice made otherwise within rounding (an MoE router's near-tie): the tokens
        # after it run other experts, and their grads move by O(1) with no bug (tests/test_moe.py)
        return None
    if dtypes is None:
        dtypes = [nj.get("dtype")]
    limit = moved_limit(dtypes)
    if moved == moved and moved <= limit:
        return None
    return float(moved), limit


def _rel_l2(pair) -> float | None:
    """||this side - reference|| / ||reference|| in float64: how far the grad as a whole moved. The
    elementwise max_rel is no size to show here: an element the reference holds near zero makes it
    any number (1e27 in a correct llama's residual-stream grads), while rounding moves the whole
    grad by ~1e-6 (float32) to ~1e-2 (bf16) and a doubled grad by ~1."""
    import torch

    if pair is None:
        return None
    a, b = pair
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
            or not a.is_floating_point():
        return None
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    ref = float(a64.norm())
    d = float((b64 - a64).norm())
    if not (d == d and ref == ref) or ref == 0.0:
        return None
    return d / ref


# the records cut reads: a module's output and output grad, a weight's grad, the logits (what a bug moves by
# O(1) and rounding by ~1e-7 in float32; a param's update moves it by lr x that, never far)
MOVED = (("forward", "out"), ("backward", "grad_out"), ("backward", "param_grad"), ("forward", "logits"))


def unlisted(entry) -> bool:
    """A degree `cut` checks: every cause summary.json names is rounding (a bug, a NaN or an unknown fails
    the gate whatever its records say - unless a policy allows unknown by name - so none is read as a cut
    list) but a router flip (after one, records move by O(1) with no bug)."""
    from tpdiag.records.causes import cause_class

    if not isinstance(entry, dict) or entry.get("downstream_unjudged") or moved_beyond(entry) is not None:
        return False  # compare's own "not judged" (downstream_unjudged), or its list moved beyond: unknown already
    found = [f for f in [entry.get("first_divergence"), *(entry.get("findings") or ())] if isinstance(f, dict)]
    return all(cause_class(f.get("cause")) == "rounding" and f.get("cause") != "router-flip" for f in found)


def cut(label: str, entry, rows: list[dict], op_dtypes=(), rerun: bool = False) -> str | None:
    """The gate's check (diff/recheck.verify) of a degree `unlisted` passes: no record from the first divergence
    on (MOVED) may have moved beyond what rounding moves an activation grad no check judged (moved_beyond's
    limit, in the least precise dtype the degree records: a float32 grad of a bf16 model rounds as bf16) and
    be no finding. Such a record is a bug whose finding was cut with its `beyond_bound` (both diff.csv files),
    or a grad not_judged should list with the list cut from both summaries - which records the float64
    re-executions judged is the oracle's verdict, cross-checked, not re-derived, but rounding moved every
    such record of the correct twins (tiny-llama, two_paths.py:pair_ok and pair_drop_ok, loop_stage.py:
    loop_ok, grad_hook_plan.py:hook_after) by under 5e-7 (the float32 limit is 1.2e-4). Each passed
    `gate --allow rounding` on main, exit 0 (red team hred16): two_paths.py:pair_drop_f (its block's grad
    27% off) with not_judged cut from both summaries and the class; two_paths.py:pair_f (its block's grad
    25% off, a bug only the second pass names) with beyond_bound cleared in both diff.csv files and its
    findings cut."""
    fd = (entry or {}).get("first_divergence") or {}
    first = next((r["idx"] for r in rows if r["key"] == fd.get("key")), None)
    if first is None:
        return None
    # op_dtypes: what the second pass's ops computed in (recheck._op_dtypes: autocast)
    limit = moved_limit([r.get("dtype") for r in rows] + list(op_dtypes))
    found = {f.get("key") for f in (entry.get("findings") or ()) if isinstance(f, dict)}
    # the grads not_judged lists are the verdict's to fail (moved_beyond, by its rel_l2: re-derived over the
    # listed ones, recheck.moved_problem); past its MAX_KEYS listed, one moved no further than its rel_l2 says
    # may be one it counts. A list of one harmless grad written into both summaries with pair_f's bug's
    # beyond_bound cleared and its findings cut passed this check when it read only an absent list (hred17)
    nj = entry.get("not_judged") if isinstance(entry.get("not_judged"), dict) else {}
    listed = {k for k in nj.get("keys") or () if isinstance(k, str)}
    said = nj.get("rel_l2") if type(nj.get("rel_l2")) is float and type(nj.get("records")) is int \
        and nj["records"] > len(listed) else None
    # only the first divergence's own step: its parameters and inputs were the reference's, so what
    # moved there moved by that step's rounding. The steps after it start from weights the update
    # already moved (tiny-llama bf16 --tp 1,2,4 --steps 3, correct: grads moved ~0.013 of their norm
    # at step 0, 0.1 at step 1, 0.24 at step 2 - past the limit, a false "edited after the run")
    # ... and a later step whose forward stayed at the first step's rounding (measured_steps: its weights
    # the reference's up to rounding): step_stale_grad.py:stale_grad_drop (mlp's output grad half off at
    # step 1) with not_judged cut from both summaries and the class passed, exit 0, reading step 0 alone
    steps = measured_steps(rows) | {str(fd.get("step"))}
    # a confirmation's rerun (rerun) runs no second pass, so no list of its own names the weight grads of
    # modules the step never called (their backward has no call to re-execute: _weight_grads); the main
    # run's not_judged lists them, held to its own records there (tied_vocab.py:tied_dfn's rerun under
    # invariant-vocab-softmax read "edited after the run"). Which modules ran is the records' own word.
    called = {(r["module"], str(r.get("step"))) for r in rows if r["phase"] == "forward" and r["kind"] in ("in", "out")}
    for r in rows:
        if (r["phase"], r["kind"]) not in MOVED or r["idx"] < first or r["bitwise"] or r["key"] in found \
                or str(r.get("step")) not in steps:
            continue
        if rerun and r["kind"] == "param_grad" and (r["module"], str(r.get("step"))) not in called:
            continue
        moved = r.get("rel_l2")
        if r["kind"] == "grad_out" and (r["key"] in listed or said is not None and isinstance(moved, float)
                                        and moved <= said):
            continue
        if isinstance(moved, float) and not moved <= limit:
            what = "does not list as not judged and has" if r["kind"] == "grad_out" else "names no bug and has"
            return (f"summary.json's TP={label} {what} no finding at {r['key']}, but that record moved {moved:.3g} of "
                    f"the reference's (rounding moves one at most {limit:.3g}): a finding, its beyond_bound or "
                    "not_judged cut (edited after the run)")
    return None
