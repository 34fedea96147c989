"""`--granularity auto`: find the first divergent module cheaply, then record ops only there.

Pass 1 records modules only. Pass 2 reruns the reference and the divergent degrees with the op
probe restricted to the first divergent module (its parent for a divergent input; the whole
phase for a backward or loss divergence, whose ops are attributed to the phase), and copies the
op it names into pass 1's first divergence. Large models stay cheap: one module's ops are kept.
"""
from __future__ import annotations

import os
from dataclasses import replace

from tpdiag.config import CompareConfig, degree_labels


def _scope(fd: dict) -> str:
    if fd["phase"] != "forward":
        return fd["phase"]
    return fd["module"]


def drill_down(cfg: CompareConfig, summary: dict, run_dir: str, on_status=None) -> dict:
    from tpdiag.runner.compare import run_compare

    labels = degree_labels(cfg.degrees)
    targets = [(lab, deg) for lab, deg in zip(labels[1:], cfg.degrees[1:])
               if (summary["degrees"].get(lab) or {}).get("first_divergence")]
    if not targets:
        return summary
    scopes = sorted({_scope(summary["degrees"][lab]["first_divergence"]) for lab, _ in targets})
    if on_status:
        on_status("ops", ", ".join(scopes))
    out = os.path.join(run_dir, "ops")
    degrees = (cfg.degrees[0],) + tuple(d for _, d in targets)
    sub = run_compare(replace(cfg, out=out, degrees=degrees, granularity="op", op_include=tuple(scopes),
                              confirm=False, baseline=False, fix_mode="explicit"))
    for (label, _), sub_label in zip(targets, degree_labels(degrees)[1:]):
        fd = summary["degrees"][label]["first_divergence"]
        sfd = (sub["degrees"].get(sub_label) or {}).get("first_divergence") or {}
        if sfd.get("key") == fd["key"] and sfd.get("op"):
            for k in ("op", "op_record", "op_detail", "op_max_abs"):
                if k in sfd:
                    fd[k] = sfd[k]
            fd["op_run_dir"] = out
        else:
            fd["op_detail"] = "op-level rerun did not reproduce this first divergence"
    return summary
