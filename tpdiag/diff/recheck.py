"""Re-derive a run directory's evidence from its records: diff.csv's rows and every number summary.json
shows (logprob and loss differences, grad norms, record counts, the records only one side holds, the
per-step table) must be what the records give today. The gate and the report both read this before any
verdict: a number edited after the run - in summary.json, in diff.csv, or in both - is inconclusive,
never shown as the run's result.

Only what `analyse_degree` computes from the records alone is re-derived here; the causes and bounds
come from the oracle pass and are cross-checked against diff.csv by records/integrity.py.
"""
from __future__ import annotations

import os

from tpdiag.errors import Inconclusive

# diff.csv's columns re-derived from the records. Floats survive the CSV round trip exactly (repr), so
# plain equality is the right test. The identity fields and rank_consistent too: the policy matches
# budgets by module/phase and judges rank-inconsistent replicas from these columns, so an edited row
# must not pass for another.
# dtype too: the not-judged limit is 1000 eps of the listed grads' dtype as diff.csv says it (gate/degree.py
# _moved_unjudged) - float32's edited to bfloat16 raised it from 1.2e-4 to 0.2 of the norm (red team hred16)
# idx and the rows' order too: the first divergence is the first divergent row in diff.csv's order
# (gate/evidence.check_summary) and a grad is past it by idx (diff/not_judged.py) - neither was re-derived
# (red team hred16, hred17). The re-diff numbers as the compare did: RecordSet renumbers only where it dropped
# a record (an expert-parallel world's idx has gaps where its rank-local records were left out)
ROW_METRICS = ("idx", "bitwise", "max_ulp", "max_abs", "max_rel", "mismatch_fraction", "rank_consistent",
               "step", "phase", "module", "kind", "call", "name", "dtype", "cls", "style", "layout", "shape")
_TEXT = ("dtype", "cls", "style", "layout", "shape")


def _keep(m: dict) -> bool:
    # the whole tensors the summary's numbers come from: logprobs (and the labels that mask them), the
    # per-step loss and grad norm; nothing else is held
    return m["kind"] in ("logprobs", "loss", "grad_norm") or (m["kind"] == "batch" and m["name"] == "labels")


def _num(v):
    """JSON carries Inf/NaN as the strings "Infinity"/"NaN" (io.json_safe)."""
    if isinstance(v, str) and v in ("Infinity", "-Infinity", "NaN"):
        return float(v.replace("Infinity", "inf"))
    return v


def same(a, b) -> bool:
    """Equal as a summary number: exact (JSON and CSV write floats by repr), NaN equal to NaN, bools not
    numbers (`True == 1` must not let an edit through)."""
    a, b = _num(a), _num(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if type(a) in (int, float) and type(b) in (int, float):
        if a != a and b != b:
            return True
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _first_difference(want, got, path: str):
    """(dotted path, summary's value, recomputed value) of the first field where they differ, or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in list(got) + [k for k in want if k not in got]:
            bad = _first_difference(want.get(k), got.get(k), f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got)):
            bad = _first_difference(w, g, f"{path}[{i}]")
            if bad:
                return bad
        return None
    return None if same(want, got) else (path, want, got)


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def recomputed(ref, other, label: str, values: bool = True, also=frozenset()):
    """(DegreeDiff, {field: value}) for the summary fields the records alone determine; also: keys whose
    tensors to hold too (not_judged's listed grads)."""
    from tpdiag.diff.analyse import _scalar, step_drift
    from tpdiag.diff.engine import diff_degree
    from tpdiag.diff import shape_break
    from tpdiag.diff.weight_ties import split_of
    from tpdiag.diff.locate import logprob_stats, nonfinite_summary

    dd = diff_degree(ref, other, label, keep=lambda m: _keep(m) or m.get("key") in also, values=values)
    loss = {"reference": _scalar(ref, "loss"), "value": _scalar(other, "loss")}
    if loss["reference"] is not None and loss["value"] is not None:
        loss["abs_diff"] = abs(loss["value"] - loss["reference"])
    got = {
        "logprobs": logprob_stats(dd),
        "loss": loss,
        "grad_norm": {"reference": _scalar(ref, "grad_norm"), "value": _scalar(other, "grad_norm")},
        "n_records": len(dd.rows),
        "n_divergent": sum(not r["bitwise"] for r in dd.rows),
        "unmatched": dd.unmatched[:50],
        "missing": dd.missing[:50],
        "nonfinite": nonfinite_summary(dd.rows),
        # the first record the ranks hold only part of: its key the records give (diff/shape_break.py)
        "shape_break": shape_break.brief(dd),
        # the weight ties the reference capture holds that this side's plan split (diff/weight_ties.py)
        "ties_split": split_of(getattr(ref, "dir", ""), getattr(other, "dir", "")),
    }
    steps = step_drift(dd)
    got["steps"] = steps if len(steps) > 1 else None
    got["first_divergent_step"] = next((s["step"] for s in steps if not s["bitwise"]), None) if len(steps) > 1 else None
    return dd, got


def _cell(row: dict, m: str):
    v = row.get(m)
    if isinstance(v, (list, tuple)):
        v = "x".join(map(str, v))  # a shape, as diff.csv spells it (records/frames.py)
    return (v or None) if m in _TEXT else v  # a row with no dtype, style... is an empty cell of diff.csv


def check_rows(label: str, rows: list[dict], csv_rows: list[dict]) -> str | None:
    want = {r["key"]: r for r in csv_rows}
    if len(want) != len(csv_rows):
        dup = next(k for k in want if sum(r["key"] == k for r in csv_rows) > 1)
        return f"diff.csv lists record {dup} of TP={label} twice (edited after the run)"
    got = {r["key"]: r for r in rows}
    if set(want) != set(got):
        k = sorted(set(want) ^ set(got))[0]
        return f"records and diff.csv list different records (first {k})"
    for k, r in got.items():
        bad = next((m for m in ROW_METRICS if not same(_cell(r, m), _cell(want[k], m))), None)
        if bad:
            return (f"record {k} does not match diff.csv ({bad} {_cell(want[k], bad)!r} in diff.csv, {_cell(r, bad)!r} in the "
                    "records: records or diff.csv edited after the run)")
    moved = next((a for a, b in zip(csv_rows, rows) if a["key"] != b["key"]), None)
    if moved is not None:
        return (f"diff.csv lists TP={label}'s records in another order than the records give (record {moved['key']} "
                "out of place: rows moved after the run)")
    return None


def check_scaled(label: str, entry: dict, rows: list[dict]) -> str | None:
    """A record one factor times the reference's (diff/scale.py: a whole tensor, or a capture's update
    of a param) is a finding with a bug label (diff/locate.py), as one beyond its bound is - but diff.csv
    has no column for the factor, so integrity's check of the findings against diff.csv could not see one
    deleted: a `tpdiag diff` whose optimizer stepped every param 2x (tests/user_opt_shard.py: lr_world),
    its findings deleted from summary.json, passed `gate --allow rounding` (red team hred13). The factor
    is re-derived here with the rows."""
    from tpdiag.records.causes import cause_class

    found = {f.get("key"): f for f in (entry or {}).get("findings") or () if isinstance(f, dict)}
    for r in rows:
        if r.get("scale") is None or r.get("bitwise"):
            continue
        f = found.get(r["key"])
        if f is None:
            return (f"summary.json's TP={label} findings lack {r['key']}, whose records are {r['scale']:.4g}x the "
                    "reference's (one factor: a bug) (edited after the run)")
        if cause_class(f.get("cause")) == "rounding" and "cause_before" not in f and f.get("cause") != "router-flip":
            return (f"summary.json's TP={label} finding {r['key']} has cause {f.get('cause')!r}, a rounding label "
                    f"for records {r['scale']:.4g}x the reference's (edited after the run)")
    return None


def check_shares(label: str, entry, dd) -> str | None:
    """summary.json's not_compared.shares are records the gate skips: each rank's copy its share of one value
    the module makes (diff/partials.py - the re-diff leaves it uncompared with that reason, SHARE_WHYS), or,
    after a hash-first pass 1 (per-rank hashes: hash-only rows), one the region pass read whole as such
    (runner/drill.py). Any other key there is an edit. On main, behind.py:bugs (its rank-inconsistent norm
    grad and averaged k/v grads) and two_paths.py:pair_f (its block's grad) listed as shares in summary.json
    and the second pass's, the findings cut, passed `gate --allow rounding`, exit 0 (red team hred17):
    records/shares.shares_problem holds summary.json's list to the second pass's, edited too."""
    from tpdiag.diff.left_out import SHARE_WHYS
    from tpdiag.records.shares import shares

    ok = {r["key"] for r in dd.rows if r.get("hash_only")}
    ok |= {m.get("key") for m in getattr(dd, "uncompared", None) or ()
           if str(m.get("why") or "").startswith(SHARE_WHYS)}
    k = next(iter(sorted(shares(entry) - ok)), None)
    if k is None:
        return None
    return (f"summary.json's TP={label} not_compared.shares lists {k}, which the records show neither as the ranks' "
            "shares of one value nor as per-rank hashes a hash-first pass read whole (edited after the run)")


def _selfcheck_failed(world) -> bool:
    sc = world.get("probe_selfcheck") if isinstance(world, dict) else None
    return sc is not None and not (isinstance(sc, dict) and sc.get("equal") is True)


def check_selfcheck(label: str, entry, ref_world: dict, world: dict, rows: list[dict]) -> str | None:
    """A world whose probed and unprobed runs differ (world.json probe_selfcheck, runner/worker.py) recorded no
    evidence: analyse_degree calls its configuration failed, and the gate fails closed on that status - which
    was summary.json's word alone: a correct run (grad_hook_plan.py:hook_after) whose TP=2 world.json says its
    self-check failed, under a summary not saying failed, passed `gate --allow rounding`, exit 0 (red team
    hred17). analyse_degree's rule is applied whole, with diff/analyse.same_degree's exception: a second world
    at the reference's own degree (`--tp 1,1`) whose records differ is a finding - two probed runs differ, so
    the step varies - divergent and not reproducible (tests/test_diagnosis.py's nondeterministic backward;
    hred17's check, which lacked it, failed that honest run and was taken out). The unprobed run's values are
    not recorded, so an edit of probe_selfcheck itself is not seen."""
    who = next((w for w, x in ((f"TP={label}", world), ("the reference", ref_world)) if _selfcheck_failed(x)), None)
    if who is None or not isinstance(entry, dict) or entry.get("status") == "failed":
        return None
    same = (is_degree(world.get("degree")) and world.get("degree") == ref_world.get("degree")
            and entry.get("axis", "tp") == "tp")
    if same and entry.get("status") == "divergent" and entry.get("reproducible") is False \
            and any(not r["bitwise"] for r in rows):
        return None
    sc = (world if who.startswith("TP=") else ref_world).get("probe_selfcheck")
    first = sc.get("first_mismatch") if isinstance(sc, dict) else sc
    return (f"{who}'s world.json says its probed and unprobed runs differ (probe_selfcheck, first mismatch "
            f"{_show(first)}): its records are no evidence, yet summary.json does not call TP={label} failed "
            "(edited after the run)")


def is_degree(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_numbers(label: str, entry: dict, got: dict) -> str | None:
    """The first summary.json number of TP=label that the records do not give, in words."""
    if not isinstance(entry, dict):
        return f"summary.json's TP={label} is not a table"
    for k, v in got.items():
        if k not in entry and v in (None, [], {}):
            continue  # an optional field the run did not need (no non-finite record, one step)
        bad = _first_difference(entry.get(k), v, k)
        if bad:
            path, w, g = bad
            return (f"summary.json's TP={label} {path} is {_show(w)} but the records give {_show(g)} "
                    "(edited after the run)")
    return None


def verify(dirs: dict[str, str], ref: str, labels: list[str], csv_rows: dict[str, list[dict]],
           entries: dict[str, dict] | None = None, base: str | None = None,
           base_reproducible: bool = True, rerun: bool = False, settled: frozenset = frozenset()) -> dict[str, str]:
    """{label: problem} where the records disagree with diff.csv or (entries given) with summary.json.

    base: the label of the reference rerun summary.json reports; its records must say what
    summary.json says of it (base_reproducible: bitwise equal to the reference's, or not).
    rerun: the directories are a confirmation's rerun (confirm/FIX/), which runs no second pass: the
    weight grads of modules it never called are the main run's to list (diff/moved_records.cut).
    settled: a rerun's configurations whose main run's verdict already fails the gate on its own
    (diff/moved_records.settled): the moved-record check is not theirs to ask.
    """
    from tpdiag.diff.engine import diff_degree
    from tpdiag.records.store import RecordSet

    try:
        ref_rs = RecordSet(dirs[ref])
    except Inconclusive as e:
        return {lab: f"reference TP={ref}: {str(e).splitlines()[0]}" for lab in labels}
    problems = {}
    read = []  # (label, RecordSet) re-diffed: their records nothing read are checked last
    op_dtypes = None  # the reference's second-pass op dtypes, read once (_op_dtypes) where a cut check asks
    for lab in labels:
        try:
            # as the diff read it: a compared side's float64 re-executions (a capture made with
            # oracle= at every degree) are no records to compare (diff/runs.py)
            rs = RecordSet(dirs[lab], drop_kinds=("oracle",))
            read.append((lab, rs))
            entry = (entries or {}).get(lab)
            nj = entry.get("not_judged") if isinstance(entry, dict) else None
            listed = frozenset(k for k in nj.get("keys") or () if isinstance(k, str)) if isinstance(nj, dict) else frozenset()
            from tpdiag.diff import optim_step

            dd, got = recomputed(ref_rs, rs, lab, also=listed | optim_step.needed(ref_rs, rs))
        except Inconclusive as e:  # NotComparable too
            problems[lab] = str(e).splitlines()[0]
            continue
        bad = check_rows(lab, dd.rows, csv_rows.get(lab, []))
        if bad is None and entries is not None:
            from tpdiag.diff import flip_check
            from tpdiag.diff.dropped_hooks import census, unnamed
            from tpdiag.diff.moved_records import cut, unlisted

            bad = (check_selfcheck(lab, entries.get(lab), ref_rs.world, rs.world, dd.rows)
                   or check_numbers(lab, entries.get(lab), got) or check_scaled(lab, entries.get(lab), dd.rows)
                   or check_shares(lab, entry, dd)
                   or flip_check.problem(lab, entry, dd.rows)
                   or census(lab, ref_rs.world, rs.world, dd.rows)
                   or unnamed(lab, entries.get(lab), dd.rows, ref_rs.world, rs.world)
                   or moved_problem(lab, nj, dd)
                   or optim_step.problem(lab, entry, dd, ref_rs, rs))
            if bad is None and unlisted(entry) and lab not in settled:
                op_dtypes = _op_dtypes(dirs[ref]) if op_dtypes is None else op_dtypes
                bad = cut(lab, entry, dd.rows, op_dtypes, rerun=rerun)
        if bad:
            problems[lab] = bad
    if base:
        try:
            rs = RecordSet(dirs[base])
            read.append((base, rs))
            dd = diff_degree(ref_rs, rs, base, keep=lambda m: False, values=False)
            differs = bool(dd.missing or dd.unmatched or dd.shape_break or any(not r["bitwise"] for r in dd.rows))
        except Inconclusive as e:  # NotComparable too
            if base_reproducible:
                problems[base] = str(e).splitlines()[0]
            differs = None  # not comparable: not reproducible, as summary.json says
        if base_reproducible and differs:
            problems[base] = "summary.json calls the reference rerun reproducible but its records differ"
        elif base_reproducible and differs is False and any(_selfcheck_failed(w) for w in (ref_rs.world, rs.world)):
            # analyse._baseline reads the rerun through analyse_degree: a failed self-check on either side is a
            # failed status there, never reproducible
            problems[base] = ("summary.json calls the reference rerun reproducible but a world.json of it or of the "
                              "reference says its probed and unprobed runs differ (edited after the run)")
        elif not base_reproducible and differs is False:
            # the other way round: a reproducible reference edited to read as nondeterministic
            problems[base] = ("summary.json calls the reference rerun not reproducible but its records are "
                              "bitwise the reference's (edited after the run)")
    # Records no comparison read (the reference's backward beside a forward-only decode configuration, a
    # record one side alone has) are still the run's capture: a value edited in one, its header intact,
    # passed the gate (red team hred10). Each is checked against its stored hash here, once.
    for lab, rs in [(ref, ref_rs), *read]:
        try:
            rs.check_every_record(need_hash=False)
        except Inconclusive as e:
            why = str(e).splitlines()[0]
            if lab == ref:
                return {**{x: f"reference TP={ref}: {why}" for x in labels}, **problems}
            problems.setdefault(lab, why)
    return problems


def _op_dtypes(ref_dir: str) -> list[str]:
    """The dtypes of the op records the second pass's reference worlds hold: the precision the model
    computes in where it records another (a float32 model whose MLP runs under torch.autocast(bf16)
    records float32 module outputs moved by bf16 rounding - user_verdicts.py:autocast, 4.3e-4 against
    float32's not-judged limit of 1.2e-4: a false "edited after the run"). Their index is read, not
    trusted blindly: a pass removed leaves only the records' own dtypes, the stricter limit."""
    from tpdiag.records.paths import SECOND_PASS_DIRS
    from tpdiag.records.record_index import read_index

    run, label = os.path.split(os.path.normpath(ref_dir))
    out = set()
    for sub in SECOND_PASS_DIRS:
        d = os.path.join(run, sub, label)
        if not os.path.isdir(d):
            continue
        try:
            _, events = read_index(d)
        except Inconclusive:
            continue
        out |= {str(m.get("dtype")) for m in events if m.get("kind") == "op" and m.get("dtype")}
    return sorted(out)


def moved_problem(label: str, nj, dd) -> str | None:
    """not_judged's rel_l2 is how far its listed grads moved (diff/not_judged.py), a number of the tensors:
    the gate fails the degree where it is beyond rounding, so it is re-derived here. Edited to 1e-9 in
    summary.json and the second pass's, two_paths.py:pair_drop_f (27% off) passed `gate --allow rounding`,
    exit 0 (red team hred16). Only the first MAX_KEYS grads are listed: their largest move bounds rel_l2
    from below, and equals it where every grad is listed."""
    from tpdiag.diff.measured_steps import measured_steps
    from tpdiag.diff.moved_limit import rel_l2

    if not isinstance(nj, dict) or not nj.get("keys"):
        return None
    # the steps not_judged.grads measures (measured_steps: why)
    steps = measured_steps(dd.rows)
    step_of = {r["key"]: str(r.get("step")) for r in dd.rows}
    moved = [m for m in (rel_l2(dd.tensors.get(k)) for k in nj["keys"] if isinstance(k, str) and step_of.get(k) in steps)
             if m is not None]
    if not moved:
        return None
    got, said = max(moved), _num(nj.get("rel_l2"))
    every = nj.get("records") == len(nj["keys"])
    if not isinstance(said, (int, float)) or isinstance(said, bool) or (not same(said, got) if every else said < got):
        return (f"summary.json's TP={label} not_judged.rel_l2 is {_show(said)} but its listed grads' records moved "
                f"{got!r} (edited after the run)")
    return None
