"""The copy-back of a second pass's summary into pass 1's entries (runner/drill.py): its
measurements of the region, its float64 verdicts and op names replace pass 1's where the rerun
computed pass 1's step and reproduced its first divergence; its findings join pass 1's."""
from __future__ import annotations

from tpdiag.records.paths import RunDir
from tpdiag.runner.drill_own import inside_consumer, near_on_own_inputs, step_differs

_VALUES = ("max_abs", "max_ulp", "mismatch_fraction", "bound", "bound_ratio")
_OPS = ("op", "op_record", "op_detail", "op_max_abs", "op_at", "bug_op")
_VERDICT = ("bound", "bound_ratio", "bound_model", "oracle")


def merge_rerun(sub: dict, *, every: dict, run_dir: str, out: str, labels, sub_labels, targets, n: int,
                hashed: bool, ops: bool, op_failed: bool, own: dict, own_hash) -> None:
    """The copy-back of a rerun's summary into pass 1's entries (the own-input pass after the
    confirmation merges its findings the same way). every: pass 1's entries by label; out: the
    rerun's folder; targets: (label, degree) of pass 1's divergent configurations, sub_labels their
    labels in the rerun (the reference's first); n: the first positions the rerun ran (0: every one);
    own / own_hash: the modules judged on their own inputs (drill_down)."""
    from tpdiag.diff.judge import settle
    from tpdiag.records.axes import entries
    from tpdiag.records.causes import cause_class

    sub_every = entries(sub)
    # the reference ran pass 1's step (its logits and parameters; its loss-phase records are of
    # the first positions); decode worlds on the first positions checked themselves (worker.py)
    ref_differs = step_differs(run_dir, labels[0], out, sub_labels[0], ("logits", "params") if n else None)
    what = "full-capture" if hashed else "op-level" if ops else "float64"
    for (label, _), sub_label in zip(targets, sub_labels[1:]):
        entry = every[label]
        fd = entry["first_divergence"]
        sub_entry = sub_every.get(sub_label) or {}
        sfd = sub_entry.get("first_divergence") or {}
        differs = ref_differs or (None if n else step_differs(run_dir, label, out, sub_label))
        if differs:
            # pass 1's probes were proven inert (its self-check); these were not, and did not
            # compute the same step: nothing they measured is evidence (records/integrity.py reads
            # these words: the rerun's findings are left out on purpose)
            fd["values_detail" if hashed else "op_detail"] = (
                f"the rerun of this region computed another step than the first pass ({differs}): "
                "its probes changed the numerics or the step is not deterministic; its values are not used")
            if label in own or own_hash:
                # fail closed: a bug behind the first divergence may be there unseen
                entry["downstream_unjudged"] = f"the float64 pass computed another step than the first pass ({differs})"
            continue
        if sub_entry.get("status") == "failed":
            # fail closed: a rerun whose worlds failed (a full disk, a crash) judged nothing - neither
            # the first divergence in float64 nor a bug behind it (records/integrity.py says so too)
            entry["downstream_unjudged"] = (f"the {what} rerun failed: "
                                            f"{str(sub_entry.get('error') or 'no error recorded').splitlines()[0][:300]}")
        if sub_entry.get("downstream_unjudged"):  # the own-input pass after a region pass
            entry["downstream_unjudged"] = sub_entry["downstream_unjudged"]
        if hashed and sfd and _shares(fd, entry, sub_entry, run_dir, label):
            fd = entry["first_divergence"]  # before the findings: none may follow one dropped
        elif hashed and sfd and fd.get("key") not in _share_keys(sub_entry):
            _later_shares(entry, sub_entry)
        # every finding the rerun made (the float64 verdicts of other roots among them)
        seen = {(f["phase"], f["module"], f["kind"], f["name"]): f for f in entry["findings"]}
        _add_float64(entry["findings"], sub_entry.get("findings") or [], _anchored(run_dir, label))
        sub_bugs = {f.get("key") for f in sub_entry.get("findings", [])
                    if "follows" not in f and cause_class(f.get("cause")) == "bug"}
        sub_follows = {f.get("key"): f.get("follows") for f in sub_entry.get("findings", [])}
        for f in sub_entry.get("findings", []):
            mine = seen.get((f["phase"], f["module"], f["kind"], f["name"]))
            same_record = next((i for i, g in enumerate(entry["findings"]) if g.get("key") == f.get("key")), None)
            if hashed and same_record is not None and _judged_whole(entry["findings"][same_record], f):
                # the same record's ranks' copies, which pass 1 had as differing hashes only, read whole
                # as shares: the region's verdict is that evidence judged better, and replaces pass 1's
                entry["findings"][same_record] = {**f, "from": "second pass"}
                continue
            if mine is not None and _same_break(entry, mine, f):
                # its position is pass 1's (the rerun's records number otherwise: it records ops)
                entry["findings"][entry["findings"].index(mine)] = {**f, "idx": mine.get("idx"), "from": "second pass"}
                continue
            if mine is not None:
                if "follows" not in mine and f.get("follows") in sub_bugs:
                    # the rerun judged an earlier record a bug that pass 1 could not (a module
                    # re-executed from its own inputs): this finding is its consequence there, so
                    # it is here too - the bug leads, not what it caused downstream
                    mine["follows"] = f["follows"]
                continue
            f = {**f, "from": "second pass"}
            flip = next((g for g in entry["findings"] if g.get("cause") == "router-flip" and "after" not in g
                         and g.get("step") == f.get("step") and g.get("phase") == "forward"), None)
            if flip is not None and (f.get("after") or f.get("cause") == "sharding-bug" and f.get("phase") != "forward"):
                # tokens that ran other experts are beyond any rounding by construction
                # (router.py): the flip explains it, as it does pass 1's later records
                continue
            same = next((g for g in entry["findings"] + [fd] if "follows" not in g and g.get("module") == f["module"]
                         and g.get("step") == f["step"] and cause_class(g.get("cause")) == "bug"), None)
            if "follows" not in f and same is not None and sub_follows.get(same.get("key")) != f.get("key"):
                # one root per module (locate.py) - unless the rerun found `same` to follow from
                # f (an earlier record pass 1 could not judge: a grad it had no record of), where
                # f leads; each following the other left no lead, and the run read rounding only
                f["follows"] = same.get("key")
            elif "follows" not in f:
                inner = inside_consumer(f, entry["findings"] + [fd])
                if inner is not None:
                    f["follows"] = inner.get("key")
            entry["findings"].append(f)
        if label in own:
            near_on_own_inputs(entry, out, sub_label)
        if sub_entry.get("not_judged"):  # the grads past the first divergence it could not judge
            entry["not_judged"] = sub_entry["not_judged"]
        if sfd.get("key") != fd["key"]:
            fd["values_detail" if hashed else "op_detail"] = (
                f"the {what} rerun of this region did not reproduce this first divergence "
                f"({sub_entry.get('status', 'failed')})")
            continue
        fd["second_pass_dir"] = out
        if hashed:
            # the whole values, measured where pass 1 had hashes: their verdict is the rerun's
            for k in _VALUES:
                if k in sfd:
                    fd[k] = sfd[k]
            fd["values_run_dir"] = out
            settle(fd, second=(sfd.get("cause"), fd.get("why")))
        if sfd.get("oracle") or sfd.get("op_oracle") or (fd.get("cause") == "unknown" and sfd.get("cause")):
            # the rerun judged it against float64 (bug or rounding) or named the reordering
            # from the module's ops: its verdict replaces pass 1's
            for k in _VERDICT + ("op_oracle",):
                if k in sfd:
                    fd[k] = sfd[k]
                elif k in ("bound", "op_oracle"):
                    fd.pop(k, None)
            settle(fd, second=(sfd.get("cause"), sfd.get("why")))
            if sfd.get("partial_grad_out"):
                # pass 1 kept no value of the output grad (each rank's share, left uncompared)
                # and said every input was equal: the rerun's detail says what was summed
                fd["partial_grad_out"], fd["detail"] = True, sfd["detail"]
        if ops and sfd.get("op"):
            for k in _OPS:
                if k in sfd:
                    fd[k] = sfd[k]
                elif k == "bug_op":
                    fd.pop(k, None)  # where a far caller's code goes wrong: the op pass's alone
            fd["op_run_dir"] = out
            # the op's name: an attention kernel (a cause only it can tell), or where an unknown enters
            settle(fd, op_pass=(fd["op"], sfd.get("cause")))
        elif ops and not fd.get("op"):
            fd["op_detail"] = "the op-level rerun named no op for this first divergence"
        if op_failed:
            fd["op_detail"] = ("no op-level rerun: the ranks recorded different op streams (not SPMD at op "
                               "level); judged at module level")


def _same_break(entry: dict, mine: dict, f: dict) -> bool:
    """Pass 1's shape break after a difference (`unknown`: pass 1 had no float64 re-execution of the code
    that made it), which the rerun judged re-executing that code (diff/shape_break.settle): a bug there
    (the gate holds it to the rerun's records: diff/recheck_pass.py), or `unknown` saying what it ran -
    its verdict replaces pass 1's."""
    brk = entry.get("shape_break") if isinstance(entry.get("shape_break"), dict) else {}
    return (mine.get("shape_break") is True and mine.get("cause") == "unknown" and f.get("shape_break") is True
            and f.get("cause") in ("sharding-bug", "unknown") and f.get("key") == mine.get("key") == brk.get("key"))


def _anchored(run_dir: str, label: str) -> set[int]:
    """The steps pass 1's world of `label` started from the reference's state (runner/anchor.py)."""
    from tpdiag.base import files as io
    from tpdiag.records.anchor import anchored_steps
    from tpdiag.records.paths import WORLD

    try:
        return anchored_steps(io.read_json(RunDir(run_dir).world_file(label, WORLD)))
    except Exception:  # noqa: BLE001 - no readable world: no step counts as anchored
        return set()


def _add_float64(findings: list, sub_findings: list, steps: set[int]) -> None:
    """A pass-1 finding at a re-anchored step (`steps`) judged by a layout bound alone, which the
    rerun judged the same way (bug, or not) against its float64 re-execution - from the same weights
    at both sides, as at step 0: that evidence joins it - the same record (its key: its step too), the
    same class. A rerun whose float64 verdict is another class changes nothing here (fail closed: the
    finding keeps pass 1's)."""
    from tpdiag.records.causes import cause_class

    mine = {f.get("key"): f for f in findings if f.get("step") in steps}
    for f in sub_findings:
        g = mine.get(f.get("key"))
        if g is not None and f.get("oracle") and not g.get("oracle") \
                and cause_class(f.get("cause")) == cause_class(g.get("cause")):
            g["oracle"] = f["oracle"]


_SHARES = "shares of a value their module reduces"


def _shares(fd: dict, entry: dict, sub_entry: dict, run_dir: str, label: str) -> bool:
    """Pass 1's first divergence a record whose per-rank hashes differ, which the full-capture
    rerun read whole and found to be each rank's share of a value its module makes one on every
    rank (diff/partials.py; left_out.SHARE_WHYS): no difference. Hashes cannot tell shares that add
    up from wrong ones, so pass 1 read them `sharding-bug` (`shares that do not add up`) and a
    correct model read BUG (shard_stats.py:rms_ok under --capture hash, gate 4). The rerun's first
    divergence - after the shares, judged there - takes its place, and pass 1's findings on those
    records go; shares that do not add up are no such record, and keep pass 1's verdict."""
    shares = _share_keys(sub_entry)
    if fd.get("key") not in shares:
        return False
    sfd = sub_entry["first_divergence"]
    # its position in pass 1's records, as every record of this summary has (a confirmation compares
    # it with its rerun's, whose records are pass 1's: runner/confirm.py)
    from tpdiag.records.rundir import read_rows

    idx = next((r["idx"] for r in read_rows(RunDir(run_dir).diff_csv)
                if str(r.get("degree")) == str(label) and r.get("key") == sfd.get("key")), None)
    if idx is None:
        return False  # not a record of pass 1: its verdict stands (fail closed)
    sfd["idx"] = idx
    entry["first_divergence"] = sfd
    sfd["values_detail"] = (f"pass 1's first divergence {fd['key']} (per-rank hashes) is, read whole, each "
                            "rank's share of a value its module reduces: not compared; the first divergence "
                            "is this record")
    _leave_uncompared(entry, shares)
    return True


def _judged_whole(mine: dict, f: dict) -> bool:
    """Whether the region pass's finding f judged pass 1's `mine` - the same record, read from its ranks'
    differing hashes alone as a replica whose copies disagree (`rank-inconsistent-replica`, no value
    compared) - from the ranks' whole copies, as shares of a sum the backward reduces later: within
    the share band (diff/partials.near_shares), on the rows a router flip left alone (diff/flip_shares.py)
    or at a step whose weights differ (partials.drifted_grad_shares). Hashes cannot tell shares from a
    replica: pass 1's BUG there was no evidence of one, and a correct MoE read BUG, gate 4, under
    --capture hash only (moe_zloss_flip.py:zloss_share, moe_bwd_bug.py:shared_beside in bf16;
    tests/test_shares_hash_judged.py). Nothing else the region says replaces a pass-1 verdict: a shape
    break, a replica no step reads, a bound - each may come of what the region did not capture, and
    pass 1's verdict from values (max_abs) was no hash's. The share rules are told by the verdict's
    structured name (`rule`, records/share_rules.py), which the gate holds every replacement to."""
    from tpdiag.records.share_rules import SHARE_RULES

    return (mine.get("cause") == "rank-inconsistent-replica" and mine.get("max_abs") is None
            and mine.get("key") is not None and f.get("key") == mine["key"] and f.get("max_abs") is not None
            and "from" not in mine and f.get("rule") in SHARE_RULES)


def _share_keys(sub_entry: dict) -> set:
    return set((sub_entry.get("not_compared") or {}).get("shares") or ())


def _later_shares(entry: dict, sub_entry: dict) -> None:
    """Records past pass 1's first divergence whose per-rank hashes differ - read from hashes alone as a
    replica whose ranks disagree (`rank-inconsistent-replica`) - which the full-capture rerun read whole
    and found to be each rank's share of one value (a router's output grad behind an MoE whose experts
    each rank runs on its own tokens: diff/partials.py): a full capture lists them "not compared", so
    this run does too. A correct MoE read BUG, gate 4, under --capture hash only (moe_bwd_bug.py:
    shared_beside, moe_late_bug.py:shared_once; tests/test_shares_later_hash.py). Copies that do not
    add up are no share there and keep pass 1's finding; a replica whose copies differ stays one."""
    shares = _share_keys(sub_entry)
    if shares:
        _leave_uncompared(entry, shares)


def _leave_uncompared(entry: dict, shares: set) -> None:
    """pass 1's findings on the shares go (a finding that followed one is judged on its own again:
    fail closed), and summary.json lists them not compared, as the region pass does (records/shares.py)."""
    entry["findings"] = [f for f in entry.get("findings") or [] if f.get("key") not in shares]
    for f in entry["findings"]:
        if f.get("follows") in shares:
            del f["follows"]
    left = entry.setdefault("not_compared", {"records": 0, "ops": 0, "why": {}, "module_records": []})
    for k in sorted(shares - set(left.get("module_records") or ())):
        left["records"] = left.get("records", 0) + 1
        left.setdefault("module_records", []).append(k)
        left.setdefault("why", {})[_SHARES] = left["why"].get(_SHARES, 0) + 1
    left["shares"] = sorted(shares | set(left.get("shares") or ()))
