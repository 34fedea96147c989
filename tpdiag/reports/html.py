"""`tpdiag report`: one self-contained HTML file from a run directory.

Self-contained means no network at view time: figures are PNG data URIs, CSS and the table
sorting script are inline. The page works without JavaScript (tables are just unsorted).
"""
from __future__ import annotations

import json
import os
import time

from tpdiag.base import files as io
from tpdiag.errors import BadInput, Inconclusive
from tpdiag.records.frames import read, rows_of
from tpdiag.records.rundir import RunDir, records_dir
# REPORT_MARK: in the first KiB of every page (templates/report.html's <title>); an existing -o file must hold it
from tpdiag.records.paths import REPORT_MARK
from tpdiag.reports import words

# Beyond this many rows per degree the records table keeps every divergent row first and
# drops bitwise ones: the browser stays responsive and diff.csv holds the complete list.
MAX_RECORD_ROWS = 3000
OPEN_MODULE_TABLE = 60  # module tables longer than this start collapsed


def _is_div(r: dict) -> bool:
    return r["bitwise"] is False or r["rank_consistent"] is False


def _cell(v) -> str:
    if isinstance(v, dict):
        if "module" in v:
            return f"{v.get('phase', '')} {v['module']}".strip()
        return ", ".join(f"{k}={_cell(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(_cell(x) for x in v)
    return words.fmt(v)


def table_of(obj) -> dict | None:
    """Any list of dicts or dict of lists (fix_chain, steps) as {"cols": [...], "rows": [[...]]}."""
    if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):
        n = max(len(v) for v in obj.values())
        obj = [{k: (v[i] if i < len(v) else None) for k, v in obj.items()} for i in range(n)]
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not obj:
        return None
    cols: list[str] = []
    for item in obj:
        for k in (item if isinstance(item, dict) else {"value": item}):
            if k not in cols:
                cols.append(k)
    rows = [[_cell((item if isinstance(item, dict) else {"value": item}).get(c)) for c in cols] for item in obj]
    return {"cols": cols, "rows": rows}


def _fix_of(cause: str, op: str | None = None):
    try:
        from tpdiag.fixes.registry import catalogue, fixes_for_cause

        names = fixes_for_cause(cause, op)  # what confirm and --fix auto apply for this cause
        return "+".join(names) or None, bool(names) and all(catalogue()[n].install is not None for n in names)
    except Exception:  # the catalogue is advice only; a report must render without it
        return None, False


def _series(rows: list[dict], fd: dict | None) -> dict:
    first_key = (fd or {}).get("key")
    pos = next((i for i, r in enumerate(rows) if r["key"] == first_key), None)
    if pos is None:
        pos = next((i for i, r in enumerate(rows) if _is_div(r)), None)
    name = (fd or {}).get("module") or (rows[pos]["module"] if pos is not None else "")
    return {"phases": [r["phase"] for r in rows], "ulp": [r["max_ulp"] for r in rows],
            "abs": [r["max_abs"] for r in rows], "first": pos, "first_name": name}


def _modules(by_label: dict[str, list[dict]]) -> list[dict]:
    """One entry per module in first-execution order: worst ULP/abs per degree and first divergent phase."""
    order: dict[str, dict] = {}
    for label, rows in by_label.items():
        for r in rows:
            m = order.setdefault(r["module"], {"module": r["module"], "cls": r.get("cls") or "",
                                               "style": r.get("style") or "", "ulp": {}, "abs": {},
                                               "n_div": 0, "first_phase": {}})
            if r.get("style"):
                m["style"] = r["style"]
            # Integer records have no ULP distance; a differing one still has to show as divergent.
            ulp = r["max_ulp"] if r["max_ulp"] is not None else int(_is_div(r))
            m["ulp"][label] = max(m["ulp"].get(label, 0), ulp)
            m["abs"][label] = max(m["abs"].get(label, 0.0), r["max_abs"] or 0.0)
            if _is_div(r):
                m["n_div"] += 1
                m["first_phase"].setdefault(label, r["phase"])
    # Parameters are recorded at init in declaration order; the forward pass is the order a
    # reader follows, so modules sort by their first forward record (at the first degree), the rest after.
    fwd: dict[str, int] = {}
    for i, r in enumerate(next(iter(by_label.values()), [])):
        if r["phase"] == "forward":
            fwd.setdefault(r["module"], i)
    return sorted(order.values(), key=lambda m: fwd.get(m["module"], len(fwd) + 10 ** 9))


def _record_rows(rows: list[dict], first_key: str | None) -> tuple[list[dict], bool]:
    if len(rows) <= MAX_RECORD_ROWS:
        keep = rows
    else:
        div = [r for r in rows if _is_div(r)][:MAX_RECORD_ROWS]
        rest = [r for r in rows if not _is_div(r)][:MAX_RECORD_ROWS - len(div)]
        chosen = {id(r) for r in div + rest}
        keep = [r for r in rows if id(r) in chosen]
    return [dict(r, div=_is_div(r), first=r["key"] == first_key) for r in keep], len(keep) < len(rows)


def _per_step(labels: list[str], ref: str, ev: dict) -> tuple[dict | None, str | None]:
    from tpdiag.reports import plots

    steps = sorted({s for lab in [ref, *labels] for s in (ev.get(lab) or {}).get("loss", {}) or {}})
    if len(steps) < 2:  # one step is already in the summary's loss / grad norm table
        return None, None
    cols, rows = ["step"], []
    series: dict[str, dict[str, list]] = {"loss": {}, "grad norm": {}}
    for kind, title in (("loss", "loss"), ("grad_norm", "grad norm")):
        for lab in [ref, *labels]:
            vals = (ev.get(lab) or {}).get(kind) or {}
            if vals:
                series[title][f"TP={lab}"] = [vals.get(s) for s in steps]
    for title, lines in series.items():
        cols += list(f"{title} {k}" for k in lines)
    for i, s in enumerate(steps):
        rows.append([str(s)] + [words.fmt(ys[i], ".9g") for lines in series.values() for ys in lines.values()])
    return {"cols": cols, "rows": rows}, plots.per_step(steps, series, f"TP={ref}")


def build_context(run_dir: str) -> dict:
    from tpdiag.reports import evidence, plots

    # The tables below render the frames `tpdiag.load` returns (diff.csv is written from the same records frame).
    run = read(run_dir)
    manifest, summary, ref = run.manifest, run.summary, run.reference
    rows = rows_of(run.records)
    from tpdiag.diff.evidence import problems as evidence_problems

    # Evidence that disagrees with the summary makes the whole report inconclusive, said at the top
    # (the same checks as tpdiag.load's, re-diff included).
    problems = evidence_problems(run_dir, manifest, summary, rows)
    from tpdiag.records.axes import entries

    degrees = entries(summary)
    labels = list(degrees)
    from tpdiag.base.points import config_name

    plain = all(config_name(lab) == f"TP={lab}" for lab in labels)
    by_label = {lab: sorted((r for r in rows if r["degree"] == lab), key=lambda r: r["idx"] or 0) for lab in labels}
    ok = [lab for lab in labels if degrees[lab].get("status") != "failed"]
    fds = {lab: degrees[lab].get("first_divergence") for lab in labels}
    dirs = {lab: records_dir(run_dir, manifest, lab) for lab in [ref, *labels]}
    ev = evidence.load(dirs, ref, ok, {lab: (fds[lab] or {}).get("key") for lab in ok}) if ok else {}
    capture = summary.get("source") == "capture"
    verdicts = [dict(words.verdict(lab, ref, degrees[lab], _fix_of, capture), label=lab,
                     records_error=(ev.get(lab) or {}).get("error")) for lab in labels]
    modules = _modules({lab: by_label[lab] for lab in ok})
    # Nothing to place on a log scale when every record is bitwise: the verdict says it in words.
    plotted = [lab for lab in ok if any(_is_div(r) for r in by_label[lab])]
    figures = {
        "divergence": plots.divergence_by_record({lab: _series(by_label[lab], fds[lab]) for lab in plotted}),
        "heatmap": plots.module_heatmap(plotted, [m["module"] for m in modules],
                                        [[m["ulp"].get(lab) for m in modules] for lab in plotted],
                                        {lab: (fds[lab] or {}).get("module") for lab in plotted}),
        "ulp": plots.ulp_histogram({lab: (ev.get(lab) or {}).get("ulp") for lab in ok},
                                   {lab: words.where(fds[lab]) if fds[lab] else "" for lab in ok}),
        "logprobs": plots.logprob_tokens({lab: (ev.get(lab) or {}).get("logprobs") for lab in ok},
                                         {lab: (degrees[lab].get("logprobs") or {}).get("token_mult_prob_error")
                                          for lab in ok}),
    }
    steps_table, figures["per_step"] = _per_step(ok, ref, ev)
    matrix = summary.get("matrix") if isinstance(summary.get("matrix"), dict) else None
    figures["matrix"] = plots.mitigation_matrix(matrix) if matrix else None
    return {
        "run_dir": os.path.abspath(run_dir), "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "status": "inconclusive" if problems else summary.get("status", "unknown"),
        "error": (f"evidence disagrees ({len(problems)} problems): " + "; ".join(problems[:3])) if problems
        else summary.get("error"), "ref": ref, "evidence_problems": problems,
        "baseline": summary.get("baseline"), "status_after_fixes": summary.get("status_after_fixes"),
        "manifest": manifest, "labels": labels, "ok_labels": ok, "degrees": degrees, "verdicts": verdicts,
        # a TP-only run's tables read "TP=2" per degree as ever; with other axes in play each
        # configuration by its axes ("TP=1 mb=2") and the tables are "configuration x module"
        "names": {lab: config_name(lab) for lab in [ref, *labels]}, "plain": plain,
        "figures": figures, "modules": modules, "open_modules": len(modules) <= OPEN_MODULE_TABLE,
        "records": {lab: _record_rows(by_label[lab], (fds[lab] or {}).get("key")) for lab in ok},
        "n_rows": {lab: len(by_label[lab]) for lab in labels},
        "steps_table": steps_table,
        "summary_steps": {lab: table_of(rows_of(run.steps[run.steps["degree"] == lab].drop(columns="degree")))
                          for lab in labels if degrees[lab].get("steps")},
        "fix_chains": {lab: table_of(degrees[lab]["fix_chain"]) for lab in labels if degrees[lab].get("fix_chain")},
        "run_fix_chain": table_of(summary.get("fix_chain")) if summary.get("fix_chain") else None,
        "matrix": matrix, "timing": _timing(manifest),
        "manifest_json": json.dumps(manifest, indent=2, default=str),
        "summary_json": json.dumps(summary, indent=2, default=str),
    }


def _timing(manifest: dict) -> dict:
    """The breakdown's checked rows (records/timing.py): a malformed one shows what was dropped."""
    from tpdiag.records.timing import read_breakdown, rows, totals_line

    tb, problems = read_breakdown(manifest)
    return {"rows": rows(tb) if tb else [], "totals": totals_line(tb) if tb else None, "problems": problems}


def _env():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("tpdiag.reports", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["f"] = words.fmt
    env.filters["pct"] = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    env.filters["code"] = _code
    return env


def _code(text: str):
    """`backticks` in verdict sentences become <code>; everything else stays escaped."""
    from markupsafe import Markup, escape

    parts = str(text).split("`")
    return Markup("".join(str(escape(p)) if i % 2 == 0 else f"<code>{escape(p)}</code>"
                          for i, p in enumerate(parts)))


def render(run_dir: str, problems: list[str] | None = None) -> str:
    """problems: where given, the evidence problems the page reports (it says inconclusive at the top)."""
    ctx = build_context(run_dir)
    if problems is not None:
        problems += ctx["evidence_problems"]
    return _env().get_template("report.html").render(**ctx)




def _copied_pass(run_dir: str) -> str | None:
    """A second pass or rerun moved or copied out of its run: its manifest says so (records/nested.py)."""
    from tpdiag.records.nested import rerun_pass
    from tpdiag.records.rundir import read_manifest

    try:
        return rerun_pass(read_manifest(run_dir), run_dir)
    except Inconclusive:
        return None  # the page and the evidence problems say what is wrong with it


def write_report(run_dir: str, out: str | None = None, problems: list[str] | None = None) -> str:
    """Render RUN_DIR and write it atomically; returns the path written (default RUN_DIR/report.html).
    problems: as render's - the CLI fails closed on them (exit 2) after the page is written."""
    path = out or RunDir(run_dir).report
    if os.path.isdir(path):
        raise BadInput(f"-o {path!r}: is a directory; expected a file name such as report.html")
    io.refuse_replacing(path, "-o", REPORT_MARK, "a tpdiag report")
    html = render(run_dir, problems)
    from tpdiag.records.nested import part_of_run

    nested = part_of_run(run_dir) or _copied_pass(run_dir)
    if nested and problems is not None:
        # a run's own pass (ops/, confirm/<fix>/, auto/round<i>/): its page is written, but the CLI exits
        # 2 as the gate does - its verdict is a part of its run's, not the user's run's verdict
        problems.insert(0, nested.replace("gate the run: tpdiag gate", "report the run: tpdiag report"))
    try:
        io.write_bytes(path, html.encode("utf-8"))
    except OSError as e:
        raise BadInput(f"-o {path!r}: cannot write ({io.why_unwritable(path, e)})") from None
    return path
