"""Does a compare's run directory agree with itself? The per-rank evidence (completion and error
markers, each world's result.json), manifest.json (its schema, its worlds) and summary.json must
tell one story. The gate and the report read this before any verdict: a summary that says
"bitwise" or "reproducible" over evidence that says otherwise is inconclusive, never a pass.

Only file reads here (records/ is the contract layer): the re-diff of the tensors is the gate's.
"""
from __future__ import annotations

import os

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive
from tpdiag.records.numbers import confirmation_problems, count_problems, number_problems, same
from tpdiag.records.paths import DIFF_CSV, SECOND_PASS_DIRS
from tpdiag.records.rundir import is_diff_dir
from tpdiag.records.run_account import labels_problem, what_ran_problems
from tpdiag.records.second_pass_ran import failed_words, pass_failed, unnamed_second_pass
from tpdiag.records.sides import fix_chain_problems, pass_identity_problem
from tpdiag.records.world_check import world_problem

SCHEMA = 1
STATUSES = ("bitwise", "divergent", "inconclusive")


def schema_ok(v) -> bool:
    # `true == 1` in Python: a schema must be the integer itself, not a bool or a float.
    return type(v) is int and v == SCHEMA


_ANOTHER_STEP = "computed another step than the first pass"  # drill.py's words: its findings not used


def _judged_downstream(run_dir: str, name: str, manifest: dict | None):
    """The run's judge_downstream setting where its manifest and its second pass's both say it (False:
    --no-judge-downstream, no own-input pass ran); one of them alone edited to False is not believed."""
    from tpdiag.records.rundir import read_manifest

    top = ((manifest or {}).get("config") or {}).get("judge_downstream")
    if top is not False:
        return top
    try:
        sub = read_manifest(os.path.join(run_dir, name))
    except Inconclusive:
        return None
    return ((sub if isinstance(sub, dict) else {}).get("config") or {}).get("judge_downstream")


def _second_pass_problems(run_dir: str, summary: dict, degrees: dict, inside: bool = False,
                          manifest: dict | None = None) -> list[str]:
    """The findings only the second pass made (a bug behind a harmless reordering, judged on its own
    inputs) live in summary.json and in the second pass's own summary: one deleted from summary.json
    alone would leave the record judged as a consequence of the first divergence."""
    sp = summary.get("second_pass")
    if not isinstance(sp, dict):
        # a second pass's own folder (inside a run): the pass inside it (region/ops) is its parent's to check
        return [] if inside else unnamed_second_pass(run_dir, summary, degrees)
    name = os.path.basename(str(sp.get("dir") or "").rstrip("/"))
    if name not in SECOND_PASS_DIRS:
        return [f"summary.json's second pass dir {sp.get('dir')!r} is not one tpdiag writes "
                f"({', '.join(SECOND_PASS_DIRS)})"]
    from tpdiag.records.axes import entries
    from tpdiag.records.causes import cause_class
    from tpdiag.records.paths import SUMMARY
    from tpdiag.records.rundir import RunDir, run_file

    try:
        sub = io.read_json(run_file(run_dir, os.path.join(name, SUMMARY)))
    except Inconclusive as e:
        return [f"summary.json names a second pass in {name}/: {str(e).splitlines()[0]}"]
    if not isinstance(sub, dict) or not isinstance(sub.get("degrees"), dict):
        return [f"{name}/summary.json: no 'degrees' table (not a tpdiag summary)"]
    # A second pass whose worlds failed (a full disk, a crash, a timeout) judged nothing: the float64
    # verdicts and the findings only it makes (a bug behind a harmless reordering) are missing, and the
    # first pass's layout bound alone is no verdict (DESIGN: bounds sharpen the oracle, never replace it).
    why = pass_failed(sub)
    if why:
        return [failed_words(name, why)]
    # after a hash-first pass the own-input judgement is one more pass inside it (region/ops): its
    # findings join the region pass's
    nested = os.path.join(name, "ops")
    inner = {}
    from tpdiag.records.own_pass import own_pass_left, own_pass_wanted, ran_here

    if name.startswith("region") and not os.path.isfile(RunDir(os.path.join(run_dir, nested)).summary) \
            and os.path.isfile(RunDir(os.path.join(run_dir, nested)).manifest):
        # the own-input pass ran (its manifest is there): without its summary its findings - a bug judged
        # on its own inputs - were dropped unseen, with the pass itself (red team hred10)
        why = ran_here(run_dir, nested)
        if why:
            return [why]
    if name.startswith("region") and not os.path.isfile(RunDir(os.path.join(run_dir, nested)).summary) \
            and own_pass_wanted(sp, sub, _judged_downstream(run_dir, name, manifest)):
        return [f"the second pass's own-input pass {nested}/ is missing, but {name}/summary.json left modules to "
                "judge on their own inputs (deleted, or the run was cut short)"]
    if name.startswith("region") and not os.path.isfile(RunDir(os.path.join(run_dir, nested)).summary) \
            and not isinstance(sp.get("own_after_confirm"), dict):
        why = own_pass_left(run_dir, name, sub, ((manifest or {}).get("config") or {}).get("judge_downstream"))
        if why:
            return [why]
    if name.startswith("region") and os.path.isfile(RunDir(os.path.join(run_dir, nested)).summary):
        try:
            n = io.read_json(run_file(run_dir, os.path.join(nested, SUMMARY)))
        except Inconclusive as e:
            return [f"the second pass's own-input pass {nested}/: {str(e).splitlines()[0]}"]
        inner = entries(n) if isinstance(n, dict) and isinstance(n.get("degrees"), dict) else {}
        name = f"{name}/ and {nested}"
    out = []
    for lab, sd in entries(sub).items():
        if isinstance(sd, dict) and isinstance(inner.get(lab), dict):
            sd = {**sd, "findings": [*(sd.get("findings") or ()), *(inner[lab].get("findings") or ())]}
        d = degrees.get(lab)
        if not isinstance(d, dict) or not isinstance(sd, dict):
            continue
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else {}
        findings = [f for f in d.get("findings") or () if isinstance(f, dict)]
        if any(f.get("cause") == "router-flip" for f in findings) or any(
                _ANOTHER_STEP in str(fd.get(k) or "") for k in ("op_detail", "values_detail")):
            continue  # drill.py leaves such findings out on purpose
        from tpdiag.records.labels import pass_label_problems
        from tpdiag.records.share_rules import SHARE_RULES
        from tpdiag.records.shares import shares_problem

        out += pass_label_problems(lab, d, sd, name)
        why = not_judged_problem(lab, d, sd, inner.get(lab), name)
        if why:
            out.append(why)
        why = shares_problem(lab, d, sd, name)
        if why:
            out.append(why)
        have = {(f.get("phase"), f.get("module"), f.get("kind"), f.get("name")) for f in findings}
        made = {(f.get("phase"), f.get("module"), f.get("kind"), f.get("name")): f
                for f in sd.get("findings") or () if isinstance(f, dict)}
        by_key = {f.get("key"): f for f in sd.get("findings") or () if isinstance(f, dict) and f.get("key")}
        for f in findings:
            if f.get("from") != "second pass":
                continue
            # by its key first: a module called twice (a rotary applied to q, then k) has two findings
            # of one (phase, module, kind, name), its calls apart
            g = by_key.get(f.get("key")) or made.get((f.get("phase"), f.get("module"), f.get("kind"), f.get("name")))
            bad = "not one" if g is None else next(
                (k for k in ("key", "phase", "module", "kind", "name", "max_abs", "bound")
                 if k in f and not same(f[k], g.get(k))), None)
            if bad is None and f.get("rule") in SHARE_RULES and not any(
                    h.get("rule") == f["rule"] for h in sd.get("findings") or ()
                    if isinstance(h, dict) and h.get("key") == f.get("key")):
                # the share rule that let it replace pass 1's hash verdict (records/share_rules.py) is the pass's own
                bad = "rule"
            if bad:
                out.append(f"summary.json's TP={lab} second-pass finding {f.get('key')}: "
                           + ("not one of " if g is None else f"{bad} {f[bad]!r} but ") + f"{name}/summary.json"
                           + ("'s findings" if g is None else f" says {g.get(bad)!r}") + " (edited after the run)")
                break
        lost = next((f for f in sd.get("findings") or () if isinstance(f, dict)
                     # an unknown one too: a far verdict no flip explains fails the gate as unknown
                     # (tests/test_moe_late_bug.py), and deleted it passed `gate --allow rounding`
                     and cause_class(f.get("cause")) in ("bug", "unknown")
                     and (f.get("phase"), f.get("module"), f.get("kind"), f.get("name")) not in have), None)
        if lost:
            out.append(f"summary.json's TP={lab} findings lack {lost.get('key')} ({lost.get('cause')}), which the "
                       f"second pass's {name}/summary.json found (edited after the run)")
    # The second pass's own files must agree with each other as a run's do (its diff.csv's records beyond
    # their bound are findings of its summary, its numbers are diff.csv's, its worlds finished): a bug it
    # found, deleted from both summaries, passed the gate. Its records are not re-diffed here (report and load
    # read this too; the cost of a second re-diff): the gate re-diffs them for beyond_bound (diff/recheck_pass.py).
    for sub_name in [os.path.basename(str(sp.get("dir")).rstrip("/"))] + ([nested] if inner else []):
        if out:
            break
        from tpdiag.records.rundir import read_manifest, read_rows

        sub_dir = os.path.join(run_dir, sub_name)
        try:
            sub_sum = io.read_json(run_file(run_dir, os.path.join(sub_name, SUMMARY)))
            sub_manifest = read_manifest(sub_dir)
            why = pass_identity_problem(read_manifest(run_dir) if manifest is None else manifest, sub_manifest,
                                        sub_name)
            if why:
                out.append(f"the second pass in {sub_name}/: {why}")
                break
            out += [f"the second pass in {sub_name}/: {p}" for p in problems(
                sub_dir, sub_manifest, sub_sum, read_rows(run_file(run_dir, os.path.join(sub_name, DIFF_CSV))),
                inside=True)]
        except Inconclusive as e:
            out.append(f"the second pass in {sub_name}/: {str(e).splitlines()[0]}")
    return out


def not_judged_problem(lab: str, d: dict, sd: dict, nested, name: str) -> str | None:
    """The grads the second pass could not judge (its not_judged, runner/drill.py copies it whole) are
    summary.json's: the gate fails them where they moved beyond rounding (gate/degree.py). Cut from
    summary.json alone, two_paths.py:pair_drop_f (its block's grad 27% off, not judged: dropout refuses
    the float64 backward) passed `gate --allow rounding`, exit 0 (red team hred16)."""
    want = sd.get("not_judged") or (nested.get("not_judged") if isinstance(nested, dict) else None)
    if want and not same(d.get("not_judged"), want):
        return (f"summary.json's TP={lab} not_judged is not the second pass's ({name}/summary.json lists "
                f"{want.get('records', '?') if isinstance(want, dict) else '?'} grads it could not judge) "
                "(edited after the run)")
    return None


def _confirmation_rows(run_dir: str, fix: str):
    """The rows of the confirmation rerun's diff.csv for `fix` (confirm/FIX/), None when unreadable."""
    from tpdiag.records.rundir import read_rows, run_file

    if os.sep in fix or fix in ("", ".", ".."):
        return None
    try:
        return read_rows(run_file(run_dir, os.path.join("confirm", fix, DIFF_CSV)))
    except (Inconclusive, OSError):
        return None


def problems(run_dir: str, manifest, summary, rows: list[dict] | None = None, inside: bool = False,
             rerun: bool = False) -> list[str]:
    """Every disagreement between manifest.json, summary.json, diff.csv's rows (when given) and the
    per-rank evidence, in words. inside: run_dir is a second pass's folder of a run; rerun: a
    confirmation's rerun (confirm/FIX/), which runs no second pass of its own."""
    out = _problems(run_dir, manifest, summary, rows, inside, rerun)
    # compare gives the manifest the summary's status as its last write (runner/session.py): the two
    # are one verdict told twice, and a reader of either must not find another (said last: the
    # evidence behind either verdict comes first)
    if isinstance(manifest, dict) and isinstance(summary, dict) and "status" in manifest \
            and manifest["status"] != summary.get("status"):
        out.append(f"manifest.json says the run is {manifest['status']!r} but summary.json says "
                   f"{summary.get('status')!r} (edited after the run)")
    return out


def _problems(run_dir: str, manifest, summary, rows: list[dict] | None, inside: bool, rerun: bool = False) -> list[str]:
    out: list[str] = []
    if not isinstance(manifest, dict):
        return [f"{run_dir}/manifest.json: not a JSON object"]
    if not isinstance(summary, dict) or not isinstance(summary.get("degrees"), dict):
        return [f"{run_dir}/summary.json: no 'degrees' table (not a tpdiag summary)"]
    if not schema_ok(manifest.get("schema")):
        out.append(f"manifest.json schema {manifest.get('schema')!r}: this tpdiag reads schema {SCHEMA}")
    if not schema_ok(summary.get("schema")):
        out.append(f"summary.json schema {summary.get('schema')!r}: this tpdiag reads schema {SCHEMA}")
    if summary.get("status") not in STATUSES:
        out.append(f"summary.json status {summary.get('status')!r}: expected one of {', '.join(STATUSES)}")
    from tpdiag.records.axes import entries

    degrees = entries(summary)
    statuses = {lab: (d or {}).get("status") if isinstance(d, dict) else None for lab, d in degrees.items()}
    if summary.get("status") == "bitwise" and any(s != "bitwise" for s in statuses.values()):
        lab = next(lab for lab, s in statuses.items() if s != "bitwise")
        out.append(f"summary.json says bitwise but TP={lab} is {statuses[lab]}")
    if summary.get("status") == "divergent" and "divergent" not in statuses.values():
        out.append("summary.json says divergent but no degree is divergent")
    if summary.get("status") != "inconclusive" and "failed" in statuses.values():
        lab = next(lab for lab, s in statuses.items() if s == "failed")
        out.append(f"summary.json says {summary.get('status')} but TP={lab} failed")
    out += number_problems(degrees, rows)
    from tpdiag.records.labels import flip_problems, made_problems

    out += flip_problems(degrees, rows) + made_problems(degrees, rows)
    from tpdiag.records.share_rules import share_rule_problems

    out += share_rule_problems(degrees, rows)
    if inside:  # the first pass's rows are the gate's own re-diff; a second pass's are read as written
        out += count_problems(degrees, rows)
    if not is_diff_dir(run_dir, manifest):
        out += what_ran_problems(manifest, summary)
        if not inside:
            out += fix_chain_problems(run_dir, manifest, summary)
    if rows is not None:
        out += confirmation_problems(degrees, lambda fix: _confirmation_rows(run_dir, fix))
    out += _second_pass_problems(run_dir, summary, degrees, inside, manifest)
    # a confirmation's rerun runs no second pass (runner/confirm.py): its first divergence at a micro-batch
    # or decode configuration is named rounding by its equal inputs alone (judge.py's axis rule), with no
    # bound - a correct MoE at --micro-batch 2,1 read "edited after the run" there, gate exit 2
    if not inside and not rerun and not is_diff_dir(run_dir, manifest):
        from tpdiag.records.labels import unjudged_problems

        out += unjudged_problems(summary, degrees, rows)  # after: what names the pass removed says it first
    for lab, st in statuses.items():
        div = [r for r in rows or () if str(r.get("degree")) == lab
               and (r.get("bitwise") is False or r.get("rank_consistent") is False)]
        if st == "bitwise" and div:
            out.append(f"summary.json says TP={lab} is bitwise but diff.csv has {len(div)} divergent records")
    if is_diff_dir(run_dir, manifest):
        # `tpdiag diff`: its evidence is the two captures, re-diffed by the gate - two runs, not one twice
        from tpdiag.records.diff_sides import diff_side_problems

        return out + diff_side_problems(run_dir, manifest)
    if manifest.get("tool") != "tpdiag compare":
        # the per-rank checks below run whatever `tool` says: an edited field must not switch them off
        out.append(f"manifest.json tool {manifest.get('tool')!r}: a run directory of tpdiag compare says "
                   "'tpdiag compare' (a tpdiag diff directory holds no tp folders and no worlds)")
    worlds = manifest.get("worlds")
    labels = manifest.get("labels")
    if not isinstance(worlds, dict) or not isinstance(labels, list) or not labels:
        out.append("manifest.json lists no worlds or labels (not a complete tpdiag compare run)")
        return out
    labels = [str(x) for x in labels]
    if str(manifest.get("reference")) != labels[0]:
        out.append(f"manifest.json reference {manifest.get('reference')!r} is not its first label {labels[0]!r}")
    for lab in labels[1:]:
        if lab not in degrees:
            out.append(f"manifest.json lists TP={lab}, absent from summary.json")
    # the gate says this too (gate/verdict.py, the same words); the report and load() need it here
    for lab in degrees:
        if lab not in labels[1:]:
            out.append(f"summary.json has TP={lab}, which manifest.json does not list")
    why = labels_problem(manifest)
    if why:
        out.append(why)
    ref, degs = summary.get("reference_label"), manifest.get("degrees")
    if ref is not None and str(ref) != labels[0]:
        out.append(f"summary.json's reference TP={ref} is not manifest.json's TP={labels[0]} (edited after the run)")
    elif isinstance(degs, list) and degs and summary.get("reference") not in (None, degs[0]):
        out.append(f"summary.json's reference degree {summary.get('reference')!r} is not manifest.json's "
                   f"{degs[0]!r} (edited after the run)")
    base = summary.get("baseline") if isinstance(summary.get("baseline"), dict) else None
    base_label = str(base["label"]) if base and base.get("label") is not None else None
    if base_label is not None and base_label not in worlds:
        out.append(f"summary.json reports the reference rerun TP={base_label}, which manifest.json never ran")
    reruns = [k for k, w in worlds.items() if k not in labels and isinstance(w, dict) and w.get("status") == "ok"]
    if base is None and reruns:
        out.append(f"manifest.json ran the reference rerun TP={reruns[0]} but summary.json reports no baseline "
                   "(edited after the run)")
    from tpdiag.records.baseline import baseline_problems

    out += baseline_problems(manifest, summary, base)
    for lab in labels + ([base_label] if base_label in worlds else []):
        w = worlds.get(lab)
        if not isinstance(w, dict):
            out.append(f"TP={lab}: no world in manifest.json")
            continue
        if w.get("status") != "ok":
            if statuses.get(lab) not in (None, "failed") or (lab == labels[0] and summary.get("status") != "inconclusive"):
                out.append(f"TP={lab}: manifest.json says the world {w.get('status')} but summary.json does not")
            continue
        why = world_problem(run_dir, manifest, lab, w.get("degree"), base_label, layout=inside)
        if why:
            out.append(why)
    return out
