"""A capture's own optimizer step: the parameters after it (`cap.params()`), judged link by link.

Past the first divergence nothing else bounds them: the grads before the step are judged, but the
update is the user's code - a clip, all-reduces of their own, the optimizer - and AdamW's first
step is about lr * sign(g), so a clip coefficient each rank computed from its own shards
(tests/user_tt_team.py clip_local, the norm not recorded) moved `norm.weight` 2 lr and read
`rounding only`. With what the capture saw the optimizer consume (probes/optim_step.py) each moved
parameter is judged by three links, each on its own side's inputs:

1. the optimizer: its class and hyper-parameters the reference's, and its update re-run in float64
   from this side's own parameter before the step, consumed grad and state reproduces this side's
   parameter after it within a few roundings of each element (the reference's too: else the step
   is not the optimizer's alone - a write after it - and nothing is judged); for a user's own
   Optimizer subclass, its own step() re-executed in float64 while the capture recorded it, each
   side judged against its own re-execution (diff/optim_own.py);
2. the grads it consumed: on each side the recorded grad (end of the backward) times one factor
   (1 without a clip), within a few roundings per element; at TP > 1 a sharded grad whose rank
   shards were scaled by factors of their own is a coefficient computed per rank (BUG);
3. the factor: this side's within the rounding of the reference's, plus how far the recorded
   grads' norm moved (a clip by the global norm moves its coefficient by no more than that).

Where all three hold, the parameter's difference is what its inputs' judged differences make.
Where one cannot be had (no optimizer seen, one tpdiag cannot re-run, a consumed grad that is no
multiple of the recorded one) the parameter is a finding of cause `unknown`, its reason saying what
to do - never `rounding only`.
"""
from __future__ import annotations

import math

import torch

# the float64 re-run of the update and the one-factor fit of the grads (links 1 and 2)
from tpdiag.diff.optim_rerun import EPS, IMPLEMENTATION, RERUN, SCALE_ROUNDINGS, _own_excess, _per_rank, fit, rerun
from tpdiag.records.keys import record_key

WHAT_TO_DO = ("record cap.grad_norm(total) when you clip, and step a torch.optim.Optimizer inside the capture's "
              "with block - torch's SGD, Adam, AdamW or your own subclass (tpdiag re-runs its step in float64)")


def _steps(world: dict) -> dict:
    """{(record step, module, name): [(entry, group, param entry), ...]} from world.json."""
    out: dict = {}
    for e in world.get("optimizer_steps") or ():
        if not isinstance(e, dict):
            continue
        for g in e.get("groups") or ():
            for p in g.get("params") or ():
                if isinstance(p, dict) and p.get("grad"):
                    out.setdefault((e.get("record_step"), p.get("module"), p.get("name")), []).append((e, g, p))
    return out


def _hyper(g: dict) -> dict:
    return {k: v for k, v in (g.get("hyper") or {}).items() if k not in IMPLEMENTATION}


def _read(rs, key: str):
    """A record's whole value: a DTensor Partial grad (a SequenceParallel norm's, not yet reduced
    when the optimizer read it) as the sum of its ranks' shares, which the optimizer's own redistribute
    makes."""
    m = rs.by_key.get(key)
    if m is None:
        return None
    t = rs.tensor(m)
    if str(m.get("placement") or "").startswith("partial") and m.get("stored") == "stacked":
        return t.to(torch.float64).sum(0).to(t.dtype)
    if m.get("stored") == "stacked":
        return None  # assembled by the diff's own pairs (dd.tensors)
    return t


def _shares_size(rs, key: str):
    """(ranks, sum of the ranks' |shares|) of a Partial record stored per rank, else (1, None)."""
    m = rs.by_key.get(key)
    if m is None or not str(m.get("placement") or "").startswith("partial") or m.get("stored") != "stacked":
        return 1, None
    t = rs.tensor(m).to(torch.float64)
    return t.shape[0], t.abs().sum(0)


def _shares_sum(rs, key: str):
    """The sum of the ranks' copies of a replica's record whose copies differ (each rank's share of a
    grad its loop all-reduces after the backward), else None."""
    m = rs.by_key.get(key)
    if m is None or m.get("stored") != "stacked" or str(m.get("placement") or "replicate") != "replicate":
        return None
    t = rs.tensor(m)
    if t.dim() == 0 or t.shape[0] < 2 or all(torch.equal(t[0], x) for x in t[1:]):
        return None
    return t.to(torch.float64).sum(0).to(t.dtype)


def _pair(dd, ref, other, key: str):
    got = dd.tensors.get(key)
    if got is not None:
        return got
    a, b = _read(ref, key), _read(other, key)
    return (a, b) if a is not None and b is not None else None


def _grad_key(ctx, dd, step, module, name):
    """The step's recorded grad of the parameter (its last call: a grad accumulated over micro-batches)."""
    if "grads" not in ctx:
        ctx["grads"] = {}
        for r in dd.rows:
            if r["kind"] == "param_grad":
                ctx["grads"][(r["module"], r["name"], r["step"])] = r["key"]  # rows in record order
    return ctx["grads"].get((module, name, step))


def _norm_move(dd, ref, other, step) -> tuple[float, int]:
    """How far (relative 2-norm) the step's recorded weight grads moved as one vector, and its size."""
    d2 = n2 = 0.0
    n = 0
    for r in dd.rows:
        if r["kind"] != "param_grad" or r["step"] != step:
            continue
        pair = _pair(dd, ref, other, r["key"])
        if pair is None or pair[0].shape != pair[1].shape:
            continue
        a, b = pair[0].to(torch.float64), pair[1].to(torch.float64)
        d2 += float(((b - a) ** 2).sum())
        n2 += float((a ** 2).sum())
        n += a.numel()
    return (math.sqrt(d2 / n2) if n2 > 0 else 0.0), n


def judge(dd, ref, other) -> list[dict]:
    """Findings for the parameters after a capture's optimizer step that no check judged (module doc);
    each moved parameter it judges within rounding gets row["update_judged"] = True."""
    if not any(rs.world.get("tool") == "tpdiag.capture" for rs in (ref, other)):
        return []
    ref_steps, other_steps = _steps(ref.world), _steps(other.world)
    from tpdiag.diff.judge import describe

    ranks = int(other.world.get("degree", 1))
    out, moves = [], {}
    for r in dd.rows:
        if (r["phase"], r["kind"]) != ("optimizer", "param") or r["bitwise"] \
                or r.get("rank_consistent") is False or r.get("scale") is not None \
                or r.get("beyond_bound") or r.get("nonfinite_mismatch"):
            continue
        step, module, name = r["step"], r["module"], r["name"]
        before_key = (record_key(0, "init", module, "param_init", 0, name) if step == 0
                      else record_key(step - 1, "optimizer", module, "param", 0, name))
        after, before = dd.tensors.get(r["key"]), dd.tensors.get(before_key)
        if after is not None and before is not None and torch.equal(after[0], before[0]) \
                and torch.equal(after[1], before[1]):
            continue  # not stepped on either side: its difference is the one before the step
        if after is None or before is None or after[0].shape != before[0].shape \
                or after[1].shape != before[1].shape:
            why, cause = ("its value before this step was not recorded at both sides (call cap.params() after "
                          "every step's optimizer step): nothing bounds its update - not judged", "unknown")
        else:
            why, cause = _judge_one(dd, ref, other, r, before, after, ref_steps.get((step, module, name)),
                                    other_steps.get((step, module, name)), ranks, moves)
        if why is None:
            r["update_judged"] = True
            continue
        out.append(describe(r, {"phase": "optimizer", "module": module, "op": None, "kind": "param", "name": name,
                                "step": step, "max_abs": r["max_abs"], "bound": None, "bound_ratio": None,
                                "key": r["key"], "detail": why, "optimizer_step": True},
                            optimizer_step=(cause, why)))
    if len(out) > 1:
        # one cause moves every parameter its step touched (a clip coefficient scales them all): one
        # root - the first bug-class finding where there is one - and the rest grouped under it (the
        # gate judges a follower on its own where its root is milder: an unknown never hides a bug)
        from tpdiag.records.causes import cause_class

        root = next((f for f in out if cause_class(f["cause"]) == "bug"), out[0])
        for f in out:
            if f is not root:
                f["follows"] = root["key"]
    return out


def _judge_one(dd, ref, other, r, before, after, at_ref, at_other, ranks, moves):
    """(None, None) where every link holds, else (why, cause). moves: the diff's memo (indexes, norm moves)."""
    step, module, name = r["step"], r["module"], r["name"]
    if not at_ref or not at_other:
        return (f"moved in the step, but the capture saw no torch.optim optimizer step it at "
                f"{'either side' if not at_ref and not at_other else 'the reference' if not at_ref else 'this degree'} "
                f"(a hand-written update outside any torch.optim.Optimizer, or capture(optimizer=False)): nothing bounds a parameter past the first "
                f"divergence - {WHAT_TO_DO}", "unknown")
    if len(at_ref) > 1 or len(at_other) > 1:
        return ("stepped more than once in the step (two optimizers over it): its update is not re-run - "
                "not judged", "unknown")
    (ea, ga, pa), (eb, gb, pb) = at_ref[0], at_other[0]
    if ea.get("class") != eb.get("class"):
        return (f"stepped by {eb.get('class')} at this degree and by {ea.get('class')} at the reference: "
                "another optimizer", "sharding-bug")
    ha, hb = _hyper(ga), _hyper(gb)
    differ = [k for k in sorted(set(ha) | set(hb)) if ha.get(k) != hb.get(k)]
    if differ:
        k = differ[0]
        return (f"its optimizer's {k} is {hb.get(k)!r} at this degree and {ha.get(k)!r} at the reference's (a "
                "hyper-parameter computed from the world size or a shard's shape): another update", "sharding-bug")
    cls = ea.get("class")
    gkey = record_key(step, "optimizer", module, "opt_grad", 0, name)
    used = _pair(dd, ref, other, gkey)
    if cls in RERUN:
        if used is None:
            return ("the grad its optimizer consumed was not recorded at both sides: not judged", "unknown")
        bad = _rerun_link(dd, ref, other, r, before, after, cls, ga, gb, pa, pb, used, moves)
    else:
        # a user's own class: its own step() re-executed in float64 while each capture recorded it
        from tpdiag.diff.optim_own import link

        bad = link(ref, other, r, before, after, at_ref[0], at_other[0], cls)
        if bad is None and used is None:
            return ("the grad its optimizer consumed was not recorded at both sides: not judged", "unknown")
    if bad is not None:
        return bad
    rkey = _grad_key(moves, dd, step, module, name)
    rec = _pair(dd, ref, other, rkey) if rkey else None
    shares = _shares_sum(other, rkey) if rkey else None
    if rec is None and shares is not None:
        a = _read(ref, rkey)
        rec = (a, shares) if a is not None else None
    if rec is None:
        return ("no recorded grad of it (capture(backward=False)) to judge the grad its optimizer consumed: not "
                "judged", "unknown")
    if used[0].shape != rec[0].shape or used[1].shape != rec[1].shape:
        return ("the grad its optimizer consumed is not of the recorded grad's shape: not judged", "unknown")
    if torch.equal(used[0], used[1]) and torch.equal(rec[0], rec[1]):
        return None, None
    (ta, ma), (tb, mb) = _shares_size(ref, gkey), _shares_size(other, gkey)
    ca, clean_a = fit(rec[0], used[0], ta, ma)
    if not clean_a:
        return ("the grad the reference's optimizer consumed is not its recorded grad times one factor (code "
                "between the backward and the step that tpdiag cannot judge): not judged; " + WHAT_TO_DO, "unknown")
    cb, clean_b = fit(rec[1], used[1], tb, mb)
    if not clean_b and shares is not None and shares.shape == used[1].shape:
        # a replica's grad each rank held as its share (Megatron-style sequence parallelism) that the
        # loop all-reduced after the backward: the optimizer read the shares' sum
        cb, clean_b = fit(shares, used[1], ranks)
    if not clean_b:
        per = _per_rank(rec[1], used[1], _layout(moves, dd, gkey), ranks)
        if per is not None and max(per) - min(per) > SCALE_ROUNDINGS * EPS.get(used[1].dtype, 2.0 ** -7) * max(map(abs, per)):
            return ("each rank scaled its shard of the grad the optimizer consumed by a factor of its own ("
                    + ", ".join(f"{c:.6g}" for c in per) + f"; the reference {ca:.6g}): a clip coefficient computed "
                    "from the rank's own shards (to_local()) - the ranks must share one, from the whole grads' norm",
                    "sharding-bug")
        return ("the grad its optimizer consumed at this degree is not the recorded grad times one factor (the "
                f"reference's is, {ca:.6g}x): code between the backward and the step did something else here that "
                "tpdiag cannot judge (a clip coefficient per rank, an all-reduce of its own) - not judged; "
                + WHAT_TO_DO, "unknown")
    if ("move", step) not in moves:
        moves[("move", step)] = _norm_move(dd, ref, other, step)
    moved, n = moves[("move", step)]
    eps = EPS.get(used[1].dtype, 2.0 ** -7)
    tol = 4 * moved + (64 + 4 * math.log2(max(n, 2))) * eps
    if ca != 0 and not abs(cb / ca - 1) <= tol:
        return (f"the grad its optimizer consumed is {cb:.6g}x the recorded grad at this degree and {ca:.6g}x at the "
                f"reference ({cb / ca:.6g} of it) while the recorded grads' norm moved {moved:.3g}: a clip "
                "coefficient or grad scale computed otherwise at this degree (a norm from other counts)",
                "sharding-bug")
    return None, None


def _rerun_link(dd, ref, other, r, before, after, cls, ga, gb, pa, pb, used, moves):
    """Link 1 for torch's SGD, Adam and AdamW: their update rule re-run in float64 from each side's own
    parameter, consumed grad and state (diff/optim_rerun.py); (why, cause) where it fails, else None."""
    step, module, name = r["step"], r["module"], r["name"]
    if "states" not in moves:
        moves["states"] = {}
        for rs in (ref, other):
            for m in rs.events:
                if m["kind"] == "opt_state" and m["call"] == 0:
                    pname, _, sk = str(m["name"]).partition(".")  # a parameter's short name has no dot
                    moves["states"].setdefault((m["step"], m["module"], pname), {})[sk] = m["key"]
    keys = moves["states"].get((step, module, name), {})
    states = ({}, {})
    for sk, k in keys.items():
        pair = _pair(dd, ref, other, k)
        if pair is None:
            return ("its optimizer state before the step was not recorded at both sides: not judged", "unknown")
        for st, v in zip(states, pair):
            st[sk] = v
    if any((p.get("step") or 0) > 0 for p in (pa, pb)) and not keys and cls != "torch.optim.sgd.SGD":
        return ("its optimizer state before the step was not recorded: not judged", "unknown")
    try:
        p64a = rerun(cls, _hyper(ga), before[0], used[0], states[0], pa.get("step"))
        p64b = rerun(cls, _hyper(gb), before[1], used[1], states[1], pb.get("step"))
    except Exception as e:  # noqa: BLE001 - the hyper-parameters of another torch version: no re-run
        return (f"its {cls} step could not be re-run ({type(e).__name__}: {e}): not judged", "unknown")
    xa, xb = _own_excess(before[0], after[0], p64a), _own_excess(before[1], after[1], p64b)
    if not xa <= 1.0:
        return (f"at the reference the parameter after the step is not what {cls} computes from the grad it "
                f"consumed ({xa:.3g}x beyond rounding: code after the step wrote it, or the optimizer is not "
                "torch's own): its update is not judged", "unknown")
    if not xb <= 1.0:
        return (f"the parameter after the step is not what {cls} computes from the grad it consumed at this "
                f"degree ({xb:.3g}x beyond rounding), while the reference's is: the step itself differs at this "
                "degree", "sharding-bug")
    return None


def _layout(ctx, dd, key):
    if "layouts" not in ctx:
        ctx["layouts"] = {r["key"]: r.get("layout") for r in dd.rows if r["kind"] == "opt_grad"}
    return ctx["layouts"].get(key)


# the records judge() reads: what the gate's re-diff (diff/recheck.verify) holds to re-derive its findings
NEEDED = ("param", "param_init", "param_grad", "opt_grad", "opt_state")


def needed(ref, other) -> frozenset:
    """The keys whose whole pairs judge() reads, where the two sides are captures (else none)."""
    if not any(rs.world.get("tool") == "tpdiag.capture" for rs in (ref, other)):
        return frozenset()
    return frozenset(m["key"] for m in other.events if m["kind"] in NEEDED)


def problem(label: str, entry, dd, ref, other) -> str | None:
    """The gate's check: every finding judge() gives from the records is in summary.json with its cause
    - a not-judged (or BUG) parameter after the user's step cut from the summary would pass as rounding."""
    got = judge(dd, ref, other)
    if not got:
        return None
    have = {f.get("key"): f.get("cause") for f in (entry or {}).get("findings") or () if isinstance(f, dict)}
    for f in got:
        if have.get(f["key"]) != f["cause"]:
            return (f"summary.json's TP={label} lacks the finding at {f['key']} ({f['cause']}) that its records give "
                    "(a parameter after the user's optimizer step: diff/optim_step.py) - edited after the run")
    return None
