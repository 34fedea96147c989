"""`tpdiag report`, `gate` and `diff`: the commands that read run directories."""
from __future__ import annotations

import json
import sys

from typing import Annotated, Optional

import typer

from tpdiag.cli.common import (DEBUG, FAIL_HELP, MALFORMED, Debug, Format, check_format, console, emit_summary,
                               exit_for, fail, malformed)
from tpdiag.errors import TpdiagError


def report(
    run_dir: Annotated[str, typer.Argument(help="a run directory written by tpdiag compare")],
    output: Annotated[Optional[str], typer.Option("-o", "--output",
                                                  help="HTML file (default RUN_DIR/report.html)")] = None,
    debug: Debug = False,
) -> None:
    """Write one self-contained HTML report (verdict, plots, tables) for a run directory.

    RUN_DIR: the --out directory of a tpdiag compare run, or of tpdiag diff."""
    DEBUG["on"] = debug
    try:
        from tpdiag.reports.html import write_report

        problems: list[str] = []
        path = write_report(run_dir, output, problems)
        if problems:
            # fail closed as the gate does: the page is written (it says inconclusive at the top) but a
            # run whose evidence disagrees with itself is never reported as done
            from tpdiag.errors import Inconclusive

            more = f" (and {len(problems) - 1} more, listed in the report)" if len(problems) > 1 else ""
            raise Inconclusive(f"{run_dir}: inconclusive, the evidence disagrees: {problems[0]}{more}; "
                               f"report written to {path}")
    except TpdiagError as e:
        fail(e)
    except MALFORMED as e:
        fail(malformed(run_dir, e))
    console().print(f"report: {path}", soft_wrap=True)


def gate(
    run_dir: Annotated[str, typer.Argument(help="a run directory written by tpdiag compare")],
    policy: Annotated[Optional[str], typer.Option(
        help="policy TOML: allowed causes, per-module ULP/abs budgets, gated degrees and phases "
             "(default: nothing may diverge); format in docs/ci.md")] = None,
    allow: Annotated[Optional[str], typer.Option(
        help="also allow these causes: `rounding` (every rounding-class cause; bugs, non-finite "
             "and unknown still fail) or cause names, comma-separated")] = None,
    junit: Annotated[Optional[str], typer.Option(help="write JUnit XML here, one testcase per degree")] = None,
    fmt: Format = "text",
    debug: Debug = False,
) -> None:
    """Exit 0 when nothing diverges beyond the policy, 1 when something does (4: a bug or NaN/Inf), 2 on incomplete evidence.

    RUN_DIR: the --out directory of a tpdiag compare run, or of tpdiag diff. The policy file's format: docs/ci.md."""
    DEBUG["on"] = debug
    import os

    from tpdiag import gate as gate_lib
    from tpdiag.gate.annotations import github_annotation
    from tpdiag.gate.junit import junit_xml

    try:
        fmt = check_format(fmt)
        if junit:
            from tpdiag.base.files import refuse_replacing
            from tpdiag.gate.junit import JUNIT_MARK

            refuse_replacing(junit, "--junit", JUNIT_MARK, "a JUnit file tpdiag gate wrote")
        result = gate_lib.evaluate(run_dir, gate_lib.with_allowed(gate_lib.load_policy(policy), allow))
        if junit:
            from tpdiag.base import files as io

            try:
                io.write_bytes(junit, junit_xml(result))
            except OSError as e:
                from tpdiag.errors import BadInput

                raise BadInput(f"--junit {junit!r}: cannot write ({io.why_unwritable(junit, e)})") from None
    except TpdiagError as e:
        fail(e)
    if fmt == "json":
        sys.stdout.write(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write("\n".join(result.lines()) + "\n")
    note = github_annotation(result)
    if note and os.environ.get("GITHUB_ACTIONS") == "true":
        sys.stdout.write(note + "\n")
    raise typer.Exit(result.exit_code)


def diff(
    run_a: Annotated[str, typer.Argument(help="the reference: a capture (tpdiag.capture out=DIR) "
                                         "or one degree of a compare run (RUN_DIR/tpN)")],
    run_b: Annotated[str, typer.Argument(help="the capture or compare degree to compare with it")],
    out: Annotated[Optional[str], typer.Option(help="where to write (default RUN_B/../diff-DATE)")] = None,
    fmt: Format = "text",
    fail_on_divergence: Annotated[bool, typer.Option("--fail-on-divergence", help=FAIL_HELP)] = False,
    debug: Debug = False,
) -> None:
    """Compare two captures, or one degree of two compare runs, with compare's analysis.

    RUN_A: the reference, RUN_B: compared with it - directories written by
    tpdiag.capture(model, out=DIR) (docs/capture.md), or RUN_DIR/tpN of two `tpdiag compare`
    runs made on different machines (docs/cross-machine.md)."""
    DEBUG["on"] = debug
    try:
        fmt = check_format(fmt)
        from tpdiag.diff.runs import diff_runs

        summary = diff_runs(run_a, run_b, out)
    except TpdiagError as e:
        fail(e)
    except MALFORMED as e:
        fail(malformed(f"{run_a} / {run_b}", e))
    emit_summary(summary, fmt)
    exit_for(summary, fail_on_divergence)
