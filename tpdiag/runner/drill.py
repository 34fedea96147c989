"""The second pass: whole values and ops only where the first pass found the first divergence.

Pass 1 is cheap: modules only (`--granularity auto`) and/or hashes only (`--capture hash`).
Pass 2 reruns the reference and the divergent degrees and records just the located region:
  - after a hash-first pass, the whole tensors of the first divergent record's module (its
    inputs, outputs, grads and parameters) - enough for max |diff|, ULPs, the rounding bound
    and the cause - and of the "suspects" (modules whose output moved far more than their
    input, by norm), whose bound checks then give the findings; everything else off;
  - for `--granularity auto`, the ops of the first divergent module (its parent for a divergent
    input; the whole phase for a backward or loss divergence, whose ops are attributed to the
    phase; after a hash pass only forward scopes, a phase's ops being as large as the model).
It copies what it measured into pass 1's first divergence. Large models stay cheap.
"""
from __future__ import annotations

import os
from functools import partial

from tpdiag.config import CompareConfig, degree_labels
from tpdiag.records.keys import sole_consumer
from tpdiag.records.paths import RunDir
from tpdiag.runner import prefix
from tpdiag.runner.drill_merge import merge_rerun
from tpdiag.runner.drill_own import own_files, own_left


def _scope(fd: dict) -> str:
    if fd["phase"] != "forward":
        return fd["phase"]
    return fd["module"]


def _callers(entry: dict) -> set[str]:
    """The op scopes that hold the code reducing a first divergence's per-rank shares: its module's
    caller. A top-level module's caller is the root (records name it "model"; as a scope, its own
    ops between its children), and the reducing module is then a sibling, no scope of the root's:
    the top-level modules whose forward input pass 1 found differing in that step, the reducing one
    among them (tests/models/planted/top_split.py:top_ok read "not judged", no op scope at all)."""
    fd = entry["first_divergence"]
    if "." in fd["module"]:
        return {fd["module"].rsplit(".", 1)[0]}
    return {"model"} | {f["module"] for f in entry.get("findings") or () if isinstance(f, dict)
                        and (f.get("phase"), f.get("kind"), f.get("step")) == ("forward", "in", fd.get("step"))
                        and isinstance(f.get("module"), str) and "." not in f["module"]}


def _record_module(fd: dict) -> str:
    from tpdiag.records.keys import RecordKey

    return RecordKey.parse(fd["key"]).module


def needs_verdict(fd: dict) -> bool:
    """A forward first divergence that no rigorous layout bound judged, or whose cause is
    unknown: the second pass re-executes it in float64 (and records its ops) to say bug or
    rounding and name the op."""
    if fd.get("cause") in ("unknown", None):
        return True
    return fd.get("phase") == "forward" and fd.get("bound") is None and not fd.get("oracle") \
        and fd.get("cause") not in ("rank-inconsistent-replica", "router-flip")


def wanted(cfg: CompareConfig, summary: dict) -> bool:
    """Whether `compare` runs the second pass: after a hash-first pass (whole values), for
    `--granularity auto|op`'s ops, or for a first divergence still without a verdict - also where
    another configuration's world failed (records/judgeable.py: the ones that ran are judged)."""
    from tpdiag.records.axes import entries
    from tpdiag.records.judgeable import judgeable

    if not judgeable(summary):
        return False

    fds = [d.get("first_divergence") for d in entries(summary).values()]
    fds = [fd for fd in fds if fd]
    return summary.get("capture") == "hash" or cfg.granularity in ("auto", "op") or any(
        needs_verdict(fd) for fd in fds) or any(
        d.get("unjudged") or (cfg.judge_downstream and d.get("own_inputs")) or _break_producer(d)
        for d in entries(summary).values())


def _break_producer(entry: dict) -> str | None:
    """The module whose code made a shape break after a difference (diff/shape_break.producer), where
    only its float64 re-execution can tell a shape it fixed from one a value decided: re-executed here."""
    brk = entry.get("shape_break") if isinstance(entry, dict) else None
    if not isinstance(brk, dict) or brk.get("after") is None or brk.get("by"):
        return None
    p = brk.get("producer")
    return p if isinstance(p, str) else None


def drill_down(cfg: CompareConfig, summary: dict, run_dir: str, on_status=None, later: list | None = None,
               records_from: dict | None = None) -> dict:
    """later: where the session confirms afterwards, a list the own-input pass after a region pass
    is appended to (a callable taking the confirmed summary) instead of running now: after the
    confirmation it judges only the modules the confirming fix leaves divergent (a bug verdict on
    a record the fixes make bitwise is dismissed anyway: DESIGN.md), and none where the fix leaves
    no divergence - at real sizes the largest part of the second pass.
    records_from: {label: world folder} of the configurations whose records an earlier pass made
    with this pass's probes (the own-input pass reads the region pass's: _judge_own_after_hash);
    taken where a world would run exactly as it ran there (runner/compare.py)."""
    from tpdiag.runner.compare import compare_pass

    from tpdiag.records.axes import entries

    every = entries(summary)
    axes = bool(cfg.micro_batches) or tuple(cfg.modes) != ("prefill",)
    if axes:  # configurations keep their labels in the rerun (CompareConfig.only)
        labels = [w.label for w in cfg.worlds()]
        targets = [(lab, lab) for lab in labels[1:] if (every.get(lab) or {}).get("first_divergence")]
    else:
        labels = degree_labels(cfg.degrees)
        targets = [(lab, deg) for lab, deg in zip(labels[1:], cfg.degrees[1:])
                   if (every.get(lab) or {}).get("first_divergence")]
    if not targets:
        return summary
    hashed = summary.get("capture") == "hash"
    fds = [every[lab]["first_divergence"] for lab, _ in targets]
    scopes = sorted({_scope(fd) for fd in fds})
    if hashed:
        scopes = [s for s in scopes if s not in ("init", "loss", "backward", "optimizer")]
    # ops where asked (auto, op) and, in the default flow, wherever a forward first divergence
    # still has no verdict: the run names the op by itself
    judge = [fd for fd in fds if fd.get("phase") == "forward" and needs_verdict(fd)]
    if hashed:
        # a forward record whose ranks' hashes differ may be each rank's share of a sum a module of
        # the caller reduces (runner/drill_merge._shares): its caller's ops too, so that the reduction,
        # read whole, is named where it becomes the first divergence (mega_split.py:split_ok)
        shares = [fd for fd in fds if (fd.get("phase"), fd.get("kind")) == ("forward", "out")
                  and fd.get("cause") == "rank-inconsistent-replica"]
        scopes = sorted(set(scopes) | {c for lab, _ in targets for c in _callers(every[lab]) if every[lab]["first_divergence"] in shares})
        judge += shares
    ops = bool(scopes) and (cfg.granularity in ("auto", "op") or bool(judge))
    if ops and cfg.granularity == "module" and not hashed:
        scopes = sorted({_scope(fd) for fd in judge})
    # the float64 oracle (probes/float64.py): each forward first divergence's own module, and
    # every op the reference records in the scopes
    oracle = sorted({_record_module(fd) for fd in fds
                     if (fd.get("phase"), fd.get("kind")) in (("forward", "out"), ("backward", "param_grad"))}
                    | {sole_consumer(fd["consumers"]) for fd in fds if fd.get("kind") == "grad_out"
                       and sole_consumer(fd.get("consumers"))}
                    | {m for lab, _ in targets for m in every[lab].get("unjudged", [])}
                    # an input that differs was computed by its caller's own code: the caller,
                    # whose inputs were equal, re-executed whole (diff/judge.py: caller_oracle)
                    | {fd["module"] for fd in fds if (fd.get("phase"), fd.get("kind")) == ("forward", "in")}
                    # after a hash-first pass, the module that takes that input too: its whole values may
                    # show the ranks' copies to be shares it reduces (diff/partials.py), and then the first
                    # divergence is its output, judged here (shard_stats.py:rms_ok read BUG at its input)
                    | ({_record_module(fd) for fd in fds if (fd.get("phase"), fd.get("kind")) == ("forward", "in")}
                       if summary.get("capture") == "hash" else set())
                    # ... and where the first divergence is itself a share (a row-parallel layer's partial
                    # returned to its caller: mega_split.py:split_ok), the modules whose forward input
                    # pass 1 found differing in that step: the one reducing it is among them
                    | ({_record_module(f) for lab, _ in targets for f in every[lab].get("findings") or ()
                        for fd in [every[lab]["first_divergence"]]
                        if (f.get("phase"), f.get("kind"), f.get("step")) == ("forward", "in", fd.get("step"))
                        and (fd.get("phase"), fd.get("kind")) == ("forward", "out")}
                       if summary.get("capture") == "hash" else set()))
    # the code that made a shape break after a difference: whether a value could decide its shape
    oracle = sorted(set(oracle) | {p for lab, _ in targets if (p := _break_producer(every[lab]))})
    # every divergent module past the first divergence, judged on this side's own inputs
    # (diff/own_inputs.py; --no-judge-downstream: off)
    own = {lab: every[lab]["own_inputs"] for lab, _ in targets
           if cfg.judge_downstream and every[lab].get("own_inputs")}
    oracle = sorted(set(oracle) | {m for ms in own.values() for m in ms})
    if not hashed and not ops and not oracle:
        return summary
    modules = []
    # after a hash-only pass: the modules to judge on their own inputs, captured whole by the
    # region pass and judged in one more pass from its records (_judge_own_after_hash)
    own_hash = sorted({m for lab, _ in targets for m in every[lab].get("own_inputs_hash", [])}
                      if hashed and cfg.judge_downstream else ())
    if hashed:
        suspects = {m for lab, _ in targets for m in every[lab].get("suspects", [])}
        # an output grad's every consumer (the oracle re-executes the outer one only): their weights
        # and output grads, whole, are what its rank-partials floor is formed from
        # (diff/rank_partials.dgrad_partials) - without them a correct bf16 column-parallel layer
        # whose partials cancel read `sharding-bug` here, rounding in a full capture
        consumers = {c for fd in fds if fd.get("kind") == "grad_out" for c in fd.get("consumers") or ()
                     if isinstance(c, str)}
        # a record past the first divergence whose ranks' hashes differ (read `rank-inconsistent-replica`
        # from hashes alone) may be each rank's share of one value, which only its whole copies show
        # (diff/partials.py; drill_merge._later_shares): its module whole, as a full capture has it -
        # without it a correct MoE's router output grad read BUG under --no-judge-downstream
        replicas = {m for lab, _ in targets for f in every[lab].get("findings") or () if isinstance(f, dict)
                    and f.get("cause") == "rank-inconsistent-replica" and isinstance(f.get("key"), str)
                    for m in (_record_module(f), f.get("module")) if isinstance(m, str)}
        modules = sorted({m for fd in fds for m in (_record_module(fd), fd["module"])} | suspects
                         | set(oracle) | set(own_hash) | consumers | replicas)
    if on_status:
        on_status("values" if hashed else "ops" if ops else "float64", ", ".join(modules or scopes or oracle))
    out = RunDir(run_dir).second_pass(hashed)
    degrees = cfg.degrees if axes else (cfg.degrees[0],) + tuple(d for _, d in targets)
    rerun = cfg.with_(
        out=out, degrees=degrees, only=tuple(lab for lab, _ in targets) if axes else (), confirm=False, baseline=False, fix_mode="explicit",
        # no unprobed rerun per world: its step must compute what pass 1's did (step_differs)
        selfcheck=False, oracle=tuple(oracle), oracle_ops=ops,
        # a pass that probes only some modules (the own-input pass after a region pass) keeps them
        capture="full" if hashed else cfg.capture, module_include=tuple(modules) or cfg.rerun.module_include,
        granularity="op" if ops else "module", op_include=tuple(scopes) if ops else ())
    sub_labels = labels[:1] + [lab for lab, _ in targets] if axes else degree_labels(degrees)
    if own:
        rerun = rerun.with_(oracle_own=own_files(run_dir, labels[0], own,
                                                  dict(zip([lab for lab, _ in targets], sub_labels[1:])),
                                                  taps={lab: every[lab].get("own_taps") for lab in own}))
    # decode configurations: first on their first positions (runner/prefix.py), where that
    # reproduces every target's first divergence and every difference pass 1 found in what it
    # records; its decode worlds prove their own probes inert (their self-check), its reference
    # that it ran pass 1's step (its logits' and parameters' fingerprint)
    # not where pass 1 named suspects (outputs that moved far more than their inputs) or
    # unjudged modules: those are judged on every position
    n = prefix.region_positions(cfg, [lab for lab, _ in targets]) if axes and not any(
        every[lab].get("suspects") or every[lab].get("unjudged") or lab in own or own_hash
        for lab, _ in targets) else 0
    sub = None
    if n:
        sub = compare_pass(rerun.with_(positions=n, prefix_from=prefix.decode_dir(run_dir, targets[0][0])))[0]
        if prefix.reproduces(run_dir, out, [lab for lab, _ in targets], every, entries(sub)):
            for lab, _ in targets:
                every[lab]["first_divergence"]["positions"] = [n, cfg.seq_len]
        else:
            if on_status:
                on_status("values" if hashed else "ops", "every position (the first ones did not reproduce it)")
            sub, n = None, 0
            out = rerun.out + "-all"
            rerun = rerun.with_(out=out)
    if sub is None:
        # its two worlds at once where neither reads the other's (runner/side_by_side.pair_gpu)
        sub = compare_pass(rerun, records_from=records_from, first=run_dir)[0]
    op_failed = ops and not n and _ops_not_spmd(sub)
    if op_failed:
        # each rank ran other ops (an MoE's experts on the tokens routed to this rank's experts:
        # other shapes per rank), so no op stream could be recorded; the modules' own float64
        # verdicts need no op records - rerun the region at module level rather than judge nothing
        if on_status:
            on_status("float64", "module level (the ranks' op streams differ)")
        out = rerun.out + "-modules"
        rerun = rerun.with_(out=out, granularity="module", op_include=(), oracle_ops=False)
        sub = compare_pass(rerun)[0]
        ops = False
    merge = partial(merge_rerun, every=every, run_dir=run_dir, out=out, labels=labels, sub_labels=sub_labels,
                    targets=targets, n=n, hashed=hashed, ops=ops, op_failed=op_failed, own=own, own_hash=own_hash)

    if own_hash and later is not None:
        region = sub

        def own_after_confirm(confirmed: dict) -> None:
            left = own_left(region, targets, sub_labels, confirmed)
            sub_every = entries(region)
            # what the late pass judged, per configuration (none: the fix left them all bitwise)
            confirmed.setdefault("second_pass", {})["own_after_confirm"] = {
                lab: list((sub_every.get(sl) or {}).get("own_inputs") or [])
                for (lab, _), sl in zip(targets, sub_labels[1:])}
            if left is not None:
                merge(_judge_own_after_hash(rerun, left, out, on_status))
                _reclear(confirmed, [lab for lab, _ in targets])

        later.append(own_after_confirm)
    elif own_hash:
        sub = _judge_own_after_hash(rerun, sub, out, on_status)
    if axes:
        _single_axis(sub, cfg, every, dict(zip([lab for lab, _ in targets], sub_labels[1:])))
    merge(sub)
    summary["second_pass"] = {"dir": out, "ops": ops, "oracle": oracle, "scopes": scopes if ops else []}
    return summary


def _reclear(summary: dict, labels) -> None:
    """The confirmation's dismissals again, over the findings the late own-input pass added."""
    from tpdiag.diff.classes import clear_by_confirmation
    from tpdiag.records.axes import entries
    from tpdiag.records.rundir import bitwise_keys

    every = entries(summary)
    for label in labels:
        conf = (every.get(label) or {}).get("confirmation") or {}
        if conf.get("run_dir"):
            clear_by_confirmation(every[label], bitwise_keys(conf["run_dir"], label))


def _ops_not_spmd(sub: dict) -> bool:
    """A rerun whose worlds failed only because their ranks recorded different op streams."""
    from tpdiag.records.axes import entries

    failed = [d for d in entries(sub).values() if d.get("status") == "failed"]
    return bool(failed) and all("not SPMD" in str(d.get("error", "")) for d in failed)


def _judge_own_after_hash(rerun: CompareConfig, sub: dict, out: str, on_status) -> dict:
    """The region pass after a hash-only first pass captured the downstream modules whole: its
    records are what a full first pass would have had, so the own-input judgement runs from them
    (one more pass, of the same modules, whose reference re-executes them in float64 from each
    side's inputs there) and its findings join the region pass's, which join the first pass's."""
    from tpdiag.records.axes import entries

    own = rerun.with_(granularity="module", op_include=(), oracle_ops=False, oracle=(), oracle_own=())
    every = entries(sub)
    if sub.get("status") != "divergent" or not any(d.get("own_inputs") for d in every.values()):
        return sub
    # the first divergences keep the region pass's verdicts (judged there with their ops); this
    # pass only adds the findings of the modules after them
    import copy

    firsts = {lab: copy.deepcopy(d.get("first_divergence")) for lab, d in every.items()}
    # its other worlds run as the region pass's did (the same modules whole, the same ops, every
    # position; only the reference's float64 oracle is new), their step proven pass 1's there
    # (drill_merge.merge_rerun: step_differs): they are not run again (compare_pass: records_from
    # where their configs match). Only the reference runs - at real sizes a decode world is most
    # of a region pass (llama-1b 1 x 2048: 51 of 68 s of this pass on an H200).
    # TPDIAG_OWN_PASS_RERUN=1: every world runs again (the A/B of the link: tests/test_own_pass_links.py)
    # The reference runs (its float64 re-executions need the step's modules) but, where it records
    # nothing else the region reference did not, writes only its float64 records and reads the rest
    # from there (compare_pass: records_from of the reference; TPDIAG_OWN_REF_BASE=0: it writes all)
    region = {} if os.environ.get("TPDIAG_OWN_PASS_RERUN", "0") == "1" else {
        lab: RunDir(out).world(lab) for lab in every}
    ref = sub.get("reference_label")
    if region and ref is not None:
        region[ref] = RunDir(out).world(ref)
    sub = drill_down(own, sub, out, on_status, records_from=region)
    for lab, d in entries(sub).items():
        if lab in firsts:
            d["first_divergence"] = firsts[lab]
    return sub


def _single_axis(sub: dict, cfg, every: dict, sub_label: dict) -> None:
    """A grid target whose TP-only configuration pass 1 found bitwise is judged, in the region
    pass's summary, along its other axis (diff/analyse.py grid_single_axis): the region pass does
    not rerun that bitwise world, so its own diff could not tell."""
    from tpdiag.diff.analyse import grid_single_axis
    from tpdiag.diff.axis_cause import name_batch_variant
    from tpdiag.records.axes import entries

    sub_every = entries(sub)
    for label, axis in grid_single_axis({w.label: w for w in cfg.worlds()}, every).items():
        entry = sub_every.get(sub_label.get(label))
        if entry is not None:
            name_batch_variant(entry, axis)
