"""`tpdiag compare --variants ...`: the mitigation matrix, variant x degree.

A variant is a plan variant and/or a fix set: `stock`, `stable`, `fix:all`,
`fix:tp-invariant-linear+invariant-gemm`, `stable+fix:all`. Every variant runs at every degree
as its own compare (confirmation off) in RUN_DIR/variants/<slug>/, against that variant's own
reference degree (a fix defines the canonical order, so TP=N with a fix is compared with the
reference with the same fix). The matrix then holds per cell: status, first divergence and
cause, logprob max abs / token_mult_prob_error, loss difference and measured step time
relative to stock at the same degree.

RUN_DIR itself looks like a plain compare of the primary variant (stock when listed, else the
first): its summary.json (plus "matrix"), manifest.json and diff.csv, with tp{label} linking to
the primary's records, so `tpdiag report`, `gate` and `confirm` work on RUN_DIR unchanged.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from tpdiag.base import files as io
from tpdiag.config import CompareConfig, degree_labels
from tpdiag.records.paths import VARIANTS_DIR, WORLD, RunDir
from tpdiag.errors import BadInput, Inconclusive

SYNTAX = "PLAN, fix:NAME[+NAME], fix:all or PLAN+fix:..., e.g. stock,stable,fix:all,stable+fix:all"


@dataclass(frozen=True)
class Variant:
    name: str                 # as the user wrote it (whitespace stripped)
    plan: str                 # plan variant: stock | stable | a py: target's own
    fixes: tuple[str, ...]    # resolved fix names
    fix_mode: str             # none | explicit | all
    slug: str                 # directory name under RUN_DIR/variants/

    @property
    def is_stock(self) -> bool:
        return self.plan == "stock" and not self.fixes

    def to_dict(self) -> dict:
        return {"name": self.name, "plan": self.plan, "fixes": list(self.fixes),
                "fix_mode": self.fix_mode, "slug": self.slug}


def _plan_names(model: str) -> tuple[str, ...] | None:
    """Plan variants the model offers; None when only the world can tell (py: targets)."""
    from tpdiag.models.plans import VARIANTS
    from tpdiag.models.spec import parse_spec

    kind = parse_spec(model).kind
    if kind == "hf":
        from tpdiag.models.plans import HF_VARIANTS

        return HF_VARIANTS
    if kind == "py":
        return None
    return VARIANTS


def parse_variant(text: str, model: str = "tiny-llama") -> Variant:
    from tpdiag.fixes.registry import catalogue, resolve

    name = text.strip()
    if not name:
        raise BadInput(f"--variants: empty variant name; expected {SYNTAX}")
    plans = _plan_names(model)
    plan, fix_names, in_fixes, is_all = None, [], False, False
    for tok in name.split("+"):
        tok = tok.strip()
        if tok.lower().startswith("fix:"):
            in_fixes, tok = True, tok[4:].strip()
        elif not in_fixes:
            if plan is not None:
                raise BadInput(f"--variants {name!r}: two plan variants ({plan}, {tok}); expected {SYNTAX}")
            if not tok or (plans is not None and tok not in plans) or \
                    (plans is None and not re.fullmatch(r"[A-Za-z][\w.-]*", tok)):
                offered = ", ".join(plans) if plans else "a plan name the target offers"
                raise BadInput(f"--variants {name!r}: unknown plan variant {tok!r}; expected {offered} "
                               f"or fix:NAME ({SYNTAX})")
            plan = tok
            continue
        if not tok:
            raise BadInput(f"--variants {name!r}: empty fix name; expected {SYNTAX}")
        if tok.lower() == "all":
            is_all = True
        fix_names.append(tok.lower())
    fixes: tuple[str, ...] = ()
    if is_all:
        fixes = resolve("all")
    for n in fix_names:
        if n == "all":
            continue
        cat = catalogue()
        if n not in cat or cat[n].install is None:
            avail = [k for k, f in cat.items() if f.install is not None]
            what = f"unknown fix {n!r}" if n not in cat else f"fix {n!r} is not available in this build yet"
            raise BadInput(f"--variants {name!r}: {what}; expected fix:all or fix:NAME with NAME one of "
                           f"{', '.join(avail)}")
        f = n
        if f not in fixes:
            fixes += (f,)
    if plan is None and not fix_names:
        raise BadInput(f"--variants {name!r}: expected {SYNTAX}")
    mode = "all" if is_all and len(fix_names) == 1 else ("explicit" if fixes else "none")
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", name.replace("fix:", "fix-")).strip("_") or "variant"
    return Variant(name, plan or "stock", fixes, mode, slug)


def parse_variants(text: str, cfg: CompareConfig) -> list[Variant]:
    """'stock,stable,fix:all' -> Variants, each validated (as a whole compare) before any world starts."""
    from tpdiag.runner.compare import validate

    parts = [p for p in str(text).split(",")]
    if not parts or any(not p.strip() for p in parts):
        raise BadInput(f"--variants {text!r}: expected a comma-separated list, {SYNTAX}")
    out: list[Variant] = []
    for p in parts:
        v = parse_variant(p, cfg.model)
        for o in out:
            if (o.plan, set(o.fixes)) == (v.plan, set(v.fixes)):
                raise BadInput(f"--variants: {v.name!r} repeats {o.name!r} (same plan and fixes)")
            if o.slug == v.slug:
                raise BadInput(f"--variants: {v.name!r} and {o.name!r} map to one directory name")
        validate(_sub_cfg(cfg, v, "", False))
        out.append(v)
    return out


def _sub_cfg(cfg: CompareConfig, v: Variant, out: str, baseline: bool) -> CompareConfig:
    # --granularity auto's op drill-down belongs to a single compare (session.py); the matrix
    # cells locate at module level (op stays op).
    gran = "module" if cfg.granularity == "auto" else cfg.granularity
    # pass_of: a variant is one cell of the matrix (no second pass), not a run of its own out of it
    return cfg.with_(out=out, variant=v.plan, fixes=v.fixes, fix_mode=v.fix_mode,
                   confirm=False, baseline=baseline, granularity=gran, pass_of=f"{VARIANTS_DIR}/{v.slug}")


def _step_s(run_dir: str, label: str) -> float | None:
    try:
        w = io.read_json(RunDir(run_dir).world_file(label, WORLD))
        t = (w.get("timings") or {}).get("steps_s")  # all steps of the world together
        n = int((w.get("config") or {}).get("steps") or 1)
        return float(t) / max(n, 1) if t is not None else None
    except (Inconclusive, OSError, ValueError, TypeError, AttributeError):
        return None


def _cell(summary: dict, label: str, ref_label: str, run_dir: str) -> dict:
    cell = {"status": None, "first_divergence": None, "cause": None, "logprobs_bitwise": None,
            "logprob_max_abs": None, "token_mult_prob_error": None, "loss": None, "loss_abs_diff": None,
            "n_divergent": None, "findings": None, "step_s": _step_s(run_dir, label),
            "step_time_vs_stock": None, "error": None}
    if label == ref_label:
        # Any compared degree carries the reference's loss; a failed reference fails every cell.
        ref_loss = next(((d.get("loss") or {}).get("reference") for d in summary["degrees"].values()
                         if d.get("status") != "failed"), None)
        failed = [d for d in summary["degrees"].values() if d.get("status") == "failed"
                  and str(d.get("error", "")).startswith(f"reference TP={ref_label} failed")]
        cell.update(status="failed" if failed else "reference", loss=ref_loss,
                    error=failed[0]["error"] if failed else None)
        return cell
    d = summary["degrees"].get(label) or {}
    cell["status"] = d.get("status", "failed")
    if cell["status"] == "failed":
        cell["error"] = d.get("error", "no result")
        return cell
    fd = d.get("first_divergence")
    if fd:
        cell["first_divergence"] = {k: fd.get(k) for k in ("module", "phase", "kind", "name", "cause",
                                                          "max_abs", "max_ulp")}
        cell["cause"] = fd.get("cause")
    lp = d.get("logprobs") or {}
    loss = d.get("loss") or {}
    cell.update(logprobs_bitwise=lp.get("bitwise"), logprob_max_abs=lp.get("max_abs"),
                token_mult_prob_error=lp.get("token_mult_prob_error"), loss=loss.get("value"),
                loss_abs_diff=loss.get("abs_diff"), n_divergent=d.get("n_divergent"),
                findings=len(d.get("findings") or []))
    last = (d.get("steps") or [{}])[-1]
    if len(d.get("steps") or []) > 1 and last.get("loss") is not None and last.get("loss_reference") is not None:
        # --steps N: the step-0 loss often agrees while later steps drift apart
        cell["loss_abs_diff_last_step"] = abs(last["loss"] - last["loss_reference"])
    return cell


def _link_records(run_dir: str, sub_dir: str, labels: list[str], manifest: dict) -> None:
    """RUN_DIR/tp{label} -> variants/<slug>/tp{label} (relative links survive a move of RUN_DIR);
    where links are not possible the manifest names the directories instead (records_dir reads it)."""
    for lab in labels:
        link, target = RunDir(run_dir).world(lab), RunDir(sub_dir).world(lab)
        if not os.path.isdir(target):
            continue
        try:
            if os.path.islink(link):
                os.unlink(link)
            elif os.path.isdir(link):
                shutil.rmtree(link)
            os.symlink(os.path.relpath(target, run_dir), link, target_is_directory=True)
        except OSError:
            manifest.setdefault("runs", {})[lab] = os.path.abspath(target)


def run_matrix(cfg: CompareConfig, variants: list[Variant], on_status=None) -> dict:
    """Run every variant at every degree; returns the primary variant's summary plus "matrix"."""
    from tpdiag.fixes import groups
    from tpdiag.records.run_files import write_manifest, write_summary
    from tpdiag.runner.compare import compare_pass

    cfg = groups.resolve(cfg)  # one G for every variant
    labels = degree_labels(cfg.degrees)
    ref_label = labels[0]
    primary = next((v for v in variants if v.is_stock), variants[0])
    stock = next((v for v in variants if v.is_stock), None)
    run_dir = cfg.out
    os.makedirs(run_dir, exist_ok=True)
    from tpdiag.records.run_files import drop_stale_report

    # an earlier run's page, at the top or of a variant, would show its verdict as this run's
    drop_stale_report(run_dir)
    for v in variants:
        drop_stale_report(RunDir(run_dir).variant(v.slug))
    summaries: dict[str, dict] = {}
    dirs: dict[str, str] = {}
    files = {}
    for v in variants:
        if on_status:
            on_status("variant", v.name)
        sub_dir = RunDir(run_dir).variant(v.slug)
        dirs[v.name] = sub_dir
        summaries[v.name], files[v.name] = compare_pass(_sub_cfg(cfg, v, sub_dir, cfg.baseline and v is primary),
                                                        on_status)
    cells: dict[str, dict[str, dict]] = {}
    for v in variants:
        cells[v.name] = {lab: _cell(summaries[v.name], lab, ref_label, dirs[v.name]) for lab in labels}
    if stock is not None:
        for v in variants:
            for lab in labels:
                mine, base = cells[v.name][lab]["step_s"], cells[stock.name][lab]["step_s"]
                if mine is not None and base:
                    cells[v.name][lab]["step_time_vs_stock"] = mine / base
    statuses = [summaries[v.name]["status"] for v in variants]
    matrix = {
        "variants": [v.name for v in variants],
        "degrees": labels,
        "reference": ref_label,
        "primary": primary.name,
        "stock": stock.name if stock else None,
        "status": "inconclusive" if "inconclusive" in statuses else
                  ("divergent" if "divergent" in statuses else "bitwise"),
        "runs": {v.name: dict(v.to_dict(), status=summaries[v.name]["status"],
                              run_dir=os.path.relpath(dirs[v.name], run_dir),
                              error=summaries[v.name].get("error")) for v in variants},
        "cells": cells,
        "timing_note": "step_s: rank 0's measured time per optimizer step (world.json timings.steps_s "
                       "/ steps; probes on, so it includes probe overhead); step_time_vs_stock divides "
                       "it by stock's at the same degree",
    }
    summary = {k: v for k, v in summaries[primary.name].items() if k != "run_dir"}
    summary["matrix"] = matrix
    p_dir = dirs[primary.name]
    manifest = dict(files[primary.name].manifest)  # the primary's, as its pass wrote it
    manifest["matrix_of"] = primary.name
    manifest["variants"] = {v.name: dict(v.to_dict(), run_dir=os.path.relpath(dirs[v.name], run_dir))
                            for v in variants}
    base = (summary.get("baseline") or {}).get("label")
    _link_records(run_dir, p_dir, labels + ([base] if base else []), manifest)
    if os.path.exists(RunDir(p_dir).diff_csv):
        with open(RunDir(p_dir).diff_csv, "rb") as f:
            io.write_bytes(RunDir(run_dir).diff_csv, f.read())
    write_manifest(run_dir, manifest)
    write_summary(run_dir, summary)
    summary["run_dir"] = run_dir
    return summary
