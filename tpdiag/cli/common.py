"""What every CLI command shares: the common options, the console, and the one place where a
library error becomes a message and an exit code (rich is imported here and in render.py only)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Annotated

import typer

from tpdiag.cli import options as H
from tpdiag.errors import TpdiagError

DEBUG = {"on": False}

Format = Annotated[str, typer.Option("--format",
                                      help=f"{H.choice('FORMATS')}: json is the machine-readable summary")]
Debug = Annotated[bool, typer.Option("--debug", help="show tracebacks")]
FAIL_HELP = ("exit 1 when any degree diverges, 4 when a bug-class or non-finite finding does (default: exit 0 "
             "with a divergent verdict; see tpdiag gate)")
QUIET_HELP = "no progress display (it is never shown when stderr is not a terminal)"


def console(stderr: bool = False):
    import os
    import sys

    from rich.console import Console

    # Piped into a CI log there is no terminal width: rich's 80 columns would cut the table's
    # numbers off. Use a wide one unless COLUMNS says otherwise.
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    # Off a terminal a line is never broken: a log or a file reader wraps (or not) on its own,
    # and a sentence split at column 200 reads as two. Tables size themselves (_print_table).
    return Console(stderr=stderr, highlight=False, width=width, soft_wrap=not stream.isatty())


def fail(e: BaseException) -> None:
    if DEBUG["on"]:
        import traceback

        traceback.print_exception(e)
    code = e.exit_code if isinstance(e, TpdiagError) else 2
    msgs = str(e).splitlines()[:1] if str(e).strip() else [words_for(e)]
    if getattr(e, "lines", False):
        msgs = [m for m in str(e).splitlines() if m.strip()]
    from rich.markup import escape

    for msg in msgs:
        # the message is text (it may quote a module name or a path with [brackets]), only the label is markup
        console(stderr=True).print(f"[bold red]error:[/] {escape(msg)}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


_NO_MESSAGE = {
    "MemoryError": "out of memory (MemoryError): an input too large for this machine's memory",
    "RecursionError": "an input nested too deeply (RecursionError)",
}


def words_for(e: BaseException) -> str:
    """One meaningful line for any exception, also one whose str() is empty (`MemoryError()`)."""
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text.splitlines()[0]}"
    return _NO_MESSAGE.get(type(e).__name__, f"{type(e).__name__} (raised without a message; --debug shows where)")


class _ClosedPipeSafe:
    """sys.stdout that survives its reader going away (`tpdiag compare ... | head -5`): the first
    write or flush that meets a closed pipe points the descriptor at /dev/null, so the rest of the
    output vanishes quietly and the command still ends with its own exit code - as well-behaved CLIs
    do - instead of a BrokenPipeError read by CI as a failure."""

    def __init__(self, stream):
        self._stream = stream

    def _closed(self) -> None:
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def write(self, data):
        try:
            return self._stream.write(data)
        except BrokenPipeError:
            self._closed()
            return len(data)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def quiet_closed_pipe() -> None:
    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real stream (a test's capture): nothing to redirect
    if not isinstance(sys.stdout, _ClosedPipeSafe):
        sys.stdout = _ClosedPipeSafe(sys.stdout)


# Raised deep inside the readers by a hand-edited or foreign run directory (valid JSON of the
# wrong shape): reported as inconclusive evidence in one line, not as a crash.
MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError)


def malformed(where: str, e: BaseException):
    from tpdiag.errors import Inconclusive

    if DEBUG["on"]:
        import traceback

        traceback.print_exception(e)
    what = str(e).splitlines()[0][:200] if str(e) else ""
    return Inconclusive(f"{where}: malformed run directory ({type(e).__name__}: {what}); "
                        "not a complete, unedited tpdiag run")


def check_format(fmt: str) -> str:
    from tpdiag.config import FORMATS, parse_choice

    return parse_choice("--format", fmt, FORMATS)


def print_rank_tracebacks(run_dir: str | None, variant: str | None = None) -> None:
    """--debug: each failed rank's own traceback (saved in tpN/rankR.error), on stderr."""
    if not run_dir:
        return
    from tpdiag.runner.rank_errors import rank_tracebacks

    where = f"variant {variant} " if variant is not None else ""
    for label, rank, tb in rank_tracebacks(run_dir):
        sys.stderr.write(f"--- {where}TP={label} rank {rank} traceback ---\n{tb.rstrip()}\n")


@contextmanager
def reported():
    """The library's typed errors as one-line messages and their exit codes; Ctrl-C as 130."""
    try:
        yield
    except TpdiagError as e:
        fail(e)
    except KeyboardInterrupt:
        console(stderr=True).print("interrupted")
        raise typer.Exit(130)


def print_json(obj) -> None:
    """obj as strict JSON on stdout (--format json)."""
    from tpdiag.base import files as io

    sys.stdout.write(io.dumps(obj, indent=2) + "\n")  # strict JSON: no bare NaN


def emit_summary(summary: dict, fmt: str, baseline_skipped: str | None = None) -> None:
    if fmt == "json":
        from tpdiag.records.axes import combination_name, not_run

        # a machine reads what a one-axis-at-a-time run left out as the text's `not run:` line says it
        missing = not_run(summary)
        if missing:
            ref = summary.get("reference_config") or {}
            summary = dict(summary, not_run=[combination_name(c, ref) for c in missing])
        from tpdiag.cli.advice import what_to_do

        # and the text's `what to do:` line, as rollout's JSON has it (a script acts on the verdict)
        todo = what_to_do(summary)
        if todo:
            summary = dict(summary, what_to_do=todo)
        print_json(summary)
    else:
        from tpdiag.cli.render import summary_tables

        summary_tables(console(), summary, baseline_skipped)


def exit_for(summary: dict, fail_on_divergence: bool) -> None:
    if summary["status"] == "inconclusive":
        raise typer.Exit(2)
    from tpdiag.records.second_pass_ran import second_pass_failed

    failed = second_pass_failed(summary.get("run_dir"), summary)
    if failed:  # fail closed: the verdict printed is the first pass's alone (DESIGN: a world failed -> 2)
        from rich.markup import escape

        console(stderr=True).print(f"[bold red]inconclusive:[/] {escape(failed)}", markup=True, soft_wrap=True)
        raise typer.Exit(2)
    if fail_on_divergence and summary["status"] == "divergent":
        from tpdiag.records.causes import EXIT_BUG
        from tpdiag.records.axes import entries

        unjudged = next((d["unjudged_capture"].get("why") for d in entries(summary).values() if isinstance(d, dict)
                         and isinstance(d.get("unjudged_capture"), dict)), None)
        if unjudged and not bug_found(summary):
            # as the gate: a capture's first divergence nothing re-executed (diff/capture_oracle.py) is
            # incomplete evidence, not a plain divergence (a wrong result there reads "not judged")
            from rich.markup import escape

            console(stderr=True).print(f"[bold red]inconclusive:[/] first divergence not judged: {escape(unjudged)}",
                                       markup=True, soft_wrap=True)
            raise typer.Exit(2)

        raise typer.Exit(EXIT_BUG if bug_found(summary) else 1)


def bug_found(summary: dict) -> bool:
    """A bug-class or non-finite cause at the first divergence or in the findings of any degree."""
    from tpdiag.records.causes import cause_class

    from tpdiag.records.axes import entries

    if summary.get("class") in ("bug", "non-finite"):  # a fix chain's later round found one
        return True
    for d in entries(summary).values():
        if not isinstance(d, dict) or d.get("status") != "divergent":
            continue
        causes = [(d.get("first_divergence") or {}).get("cause")] + [f.get("cause") for f in d.get("findings") or []]
        if d.get("nonfinite") or any(cause_class(c) in ("bug", "non-finite") for c in causes if c):
            return True
    return False


