"""Link 1 of diff/optim_step.py for a user's own optimizer class: its own `step()` re-executed in
float64 while each capture recorded it (probes/optim_shadow.py), on that side's own parameter, grad
and state - each DTensor gathered whole - with the same param_groups.

With o_S that re-execution at side S and y_S its parameter after the real step:

    e_ref = ||y_ref - o_ref||,   e_N = ||y_N - o_N||,   far <=> e_N > A(n) max(e_ref, u ||o_N||)

as the module oracle (diff/oracle_verdict.py): a correct step at TP=N is the same function of its
inputs, only rounded otherwise (a gathered grad, its own shards' elementwise update), so its own
error sits within a few times the reference's, which measures this step's rounding for these data
and this dtype (a bf16 Newton-Schulz included). Each side against its OWN re-execution: the grads
two sides consumed differ by their judged rounding, and a step amplifies that (Muon's
orthogonalisation lifts small singular directions; Lion's sign) - the consumed grads are links 2
and 3. A step that is another function at TP=N - Muon's Newton-Schulz on each rank's shard, a rank
that decays its shard twice - is far: `sharding-bug`. Not judged (`unknown`), one line why: no
re-execution recorded (a capture from before it), one refused (a closure - torch's LBFGS -, a
collective or a rank asked for in step(), a state tensor per shard...), a
parameter stepped as each rank's plain shard, a reference whose distance to its own re-execution, times A, reaches its whole update (code
after the step wrote it; a step that is no float64-safe function of its inputs; a bf16 Newton-Schulz
of a grad of lower rank than the matrix), and a
far side whose step made a jump (probes/optim_shadow.JUMPS: Lion's sign flips an element by 2 lr
where its argument is within rounding of zero, without any bug)."""
from __future__ import annotations

import torch

from tpdiag.records.keys import OPT_F64, record_key



def _read(rs, key):
    """(the whole value or None, whether its ranks re-executed other values)."""
    m = rs.by_key.get(key)
    if m is None:
        return None, False
    if m.get("stored") == "stacked":
        return None, True  # each rank re-ran its own values: no one whole value
    return rs.tensor(m), False


def link(ref, other, r, before, after, at_ref, at_other, cls: str):
    """(why, cause) where link 1 fails or cannot be had for a user's own optimizer, else None."""
    from tpdiag.diff.bits import UNIT_ROUNDOFF
    from tpdiag.diff.oracle_verdict import margin

    (ea, _, pa), (eb, _, pb) = at_ref, at_other
    fa, fb = ea.get("f64"), eb.get("f64")
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        return (f"stepped by {cls}, whose step the capture did not re-execute in float64 at "
                f"{'the reference' if not isinstance(fa, dict) else 'this degree'} (a capture made before tpdiag "
                "re-executed this optimizer: capture again): nothing bounds its update - not judged", "unknown")
    for side, f in (("the reference", fa), ("this degree", fb)):
        if f.get("refused"):
            return (f"its {cls}.step() could not be re-executed in float64 at {side}: {f['refused']} - not judged",
                    "unknown")
    step, module, name = r["step"], r["module"], r["name"]
    oa, apart_a = _read(ref, record_key(step, "optimizer", module, OPT_F64, pa.get("call", 0), name))
    ob, apart_b = _read(other, record_key(step, "optimizer", module, OPT_F64, pb.get("call", 0), name))
    if apart_a or apart_b:
        return (f"its {cls}.step() re-executed in float64 gave another value on each rank at "
                f"{'the reference' if apart_a else 'this degree'} (each rank re-ran its own parameter: a plain "
                "tensor shard, or replicas that differ): its step on the whole tensor cannot be re-run - not judged",
                "unknown")
    if oa is None or ob is None:
        return ("its optimizer's float64 re-execution was not recorded (one whole value) at both sides: not "
                "judged", "unknown")
    if tuple(ob.shape) != tuple(after[1].shape) or tuple(oa.shape) != tuple(after[0].shape):
        return (f"its {cls} stepped each rank's shard as a plain tensor (re-executed on a {list(ob.shape)} tensor "
                f"for a {list(after[1].shape)} parameter): its step on the whole tensor cannot be re-run - not judged",
                "unknown")
    f64 = torch.float64
    ya, yb, a0 = after[0].to(f64), after[1].to(f64), before[0].to(f64)
    oa, ob = oa.to(f64), ob.to(f64)
    if not all(bool(torch.isfinite(t).all()) for t in (ya, yb, oa, ob)):
        return (f"its {cls} step or its float64 re-execution is not finite: not judged", "unknown")
    e_a = float(torch.linalg.vector_norm(ya - oa))
    e_b = float(torch.linalg.vector_norm(yb - ob))
    upd = float(torch.linalg.vector_norm(oa - a0))
    a = margin(max(1, ob.numel()))
    if a * e_a >= upd:
        # the rounding a reordering may reach covers the whole update: nothing about it is judged (a
        # write after the step; a bf16 Newton-Schulz of a grad of lower rank than the matrix, whose
        # near-zero singular directions it lifts from rounding noise to O(1))
        return (f"at the reference the parameter after the step is {e_a / upd if upd else float('inf'):.3g} of its "
                f"update away from what {cls}.step() computes in float64 from its own inputs (code after the step "
                "wrote it, or the step is no float64-safe function of its parameter, grad and state): its update "
                "is not judged", "unknown")
    u = UNIT_ROUNDOFF.get(after[1].dtype, UNIT_ROUNDOFF[torch.float32])
    level = max(e_a, u * float(torch.linalg.vector_norm(ob)))
    if not e_b > a * level:
        return None
    x = e_b / level if level > 0 else float("inf")
    jumps = sorted(set(fa.get("jumps") or ()) | set(fb.get("jumps") or ()))
    if jumps:
        return (f"the parameter after the step is {x:.3g}x farther from what {cls}.step() computes in float64 from "
                "this degree's own inputs than the reference's is from its own, but the step makes a choice a "
                f"rounding can flip ({', '.join(jumps)}: an element moved by its whole step without any bug) - not "
                "judged", "unknown")
    return (f"the parameter after the step is {x:.3g}x farther from what {cls}.step() computes in float64 from this "
            f"degree's own parameter, grad and state (the whole tensors, gathered) than the reference's is from its "
            f"own (a reordering stays within {a:.3g}x): the step itself differs at this degree - what "
            "needs the whole matrix computed on each rank's shard (Muon's Newton-Schulz), or an update that "
            "depends on the rank", "sharding-bug")
