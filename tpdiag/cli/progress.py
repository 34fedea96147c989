"""The CLI's live per-world status while a compare runs (rich, on a terminal only)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from tpdiag.base.points import config_name


@contextmanager
def progress(console, cfg, quiet: bool = False):
    """Live per-world status on a terminal; nothing at all with --quiet or when stderr is a
    file or a pipe (a spinner there leaves control lines and a stale last frame)."""
    if quiet or not console.is_terminal:
        yield lambda label, status: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    labels = [w.label for w in cfg.worlds()]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as p:
        tasks = {lab: p.add_task(f"{config_name(lab)}{' (reference)' if i == 0 else ''}: waiting", total=1)
                 for i, lab in enumerate(labels)}
        tasks["diff"] = p.add_task("diff: waiting", total=1)
        started = {}

        def on_status(label: str, status: str) -> None:
            t = tasks.get(label)
            if t is None:
                if label in ("confirm", "auto", "variant"):
                    key = f"{label}:{status}"
                    if key not in tasks:
                        tasks[key] = p.add_task(f"{label}: {status}", total=None)
                    for k, tid in tasks.items():
                        if k.startswith(label + ":") and k != key:
                            p.update(tid, total=1, completed=1)
                return
            name = "diff" if label == "diff" else f"{config_name(label)}"
            if status.startswith("running:"):  # progress inside the world (runner/progress.py)
                p.update(t, description=f"{name}: running, {status[len('running:'):]}")
            elif status == "running":
                started[label] = time.perf_counter()
                p.update(t, description=f"{name}: running")
            else:
                dt = time.perf_counter() - started.get(label, time.perf_counter())
                mark = "[green]done[/]" if status == "ok" else "[red]FAILED[/]"
                p.update(t, description=f"{name}: {mark} ({dt:.1f} s)", completed=1)

        yield on_status
