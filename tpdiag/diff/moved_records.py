"""The gate's moved-record check (diff/recheck.verify): in a degree whose summary names only
rounding, no record from the first divergence on may have moved beyond what rounding moves a record
no check judged (diff/moved_limit.py) and be no finding - that is a finding or a list cut after the run."""
from __future__ import annotations

from tpdiag.diff.measured_steps import measured_steps
from tpdiag.diff.moved_limit import moved_beyond, moved_limit

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


def settled(entry) -> bool:
    """A main run's configuration whose own verdict already names what the gate fails on: a bug, a NaN or
    Inf, an unknown (a cause, compare's own "not judged", its not_judged list moved beyond rounding).
    Its confirmation's rerun ran under a fix that only reorders, so the same wrong records move there;
    the rerun's summary may not name them (it judges only a first divergence without a cause, where
    the main run's second pass judged every divergent module on its own inputs: trial25_tp_hand.py:
    late_scale's confirmation named rounding only), and the moved-record check read that as an edit -
    gate exit 2 over the bug's 4. Not asked of such a rerun (diff/overrides.py)."""
    from tpdiag.records.causes import GRAVITY, cause_class

    if not isinstance(entry, dict):
        return False
    if entry.get("downstream_unjudged") or moved_beyond(entry) is not None:
        return True
    found = [f for f in [entry.get("first_divergence"), *(entry.get("findings") or ())] if isinstance(f, dict)]
    return any(cause_class(f.get("cause")) in GRAVITY[:3] for f in found)  # bug, non-finite, unknown


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
