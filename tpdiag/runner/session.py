"""What `tpdiag compare` does end to end: the compare, then confirmation or the auto fix chain."""
from __future__ import annotations

import os
from dataclasses import replace

from tpdiag import io
from tpdiag.records.rundir import read_summary
from tpdiag.config import CompareConfig


def compare_session(cfg: CompareConfig, on_status=None) -> dict:
    from tpdiag.runner.compare import run_compare
    from tpdiag.runner.confirm import auto_chain, confirm

    if cfg.fix_mode == "auto":
        summary = auto_chain(cfg, cfg.out, on_status)
        first = read_summary(cfg.out)
        first["fix_chain"] = summary["fix_chain"]
        first["status_after_fixes"] = summary["status"]
        io.write_json(os.path.join(cfg.out, "summary.json"), first)
        first["run_dir"] = cfg.out
        return first
    summary = run_compare(replace(cfg, granularity="module") if cfg.granularity == "auto" else cfg,
                          on_status)
    if summary["status"] == "divergent" and (cfg.granularity == "auto"
                                             or summary.get("capture") == "hash"):
        from tpdiag.runner.drill import drill_down

        summary = drill_down(cfg, summary, cfg.out, on_status)
        io.write_json(os.path.join(cfg.out, "summary.json"),
                      {k: v for k, v in summary.items() if k != "run_dir"})
    if cfg.confirm and summary["status"] == "divergent":
        summary = confirm(cfg, summary, cfg.out, on_status=on_status)
        out = {k: v for k, v in summary.items() if k != "run_dir"}
        io.write_json(os.path.join(cfg.out, "summary.json"), out)
    return summary
