"""Command-line wiring: the `tpdiag` app and its commands (each group's in its own module:
compare.py, rollout.py, verdicts.py). The library raises typed errors; only tpdiag/cli/ prints
and picks exit codes."""
from __future__ import annotations

import json
import sys

from typing import Annotated

import typer

from tpdiag.cli import options as H
from tpdiag.cli.common import DEBUG, Format, check_format, console, fail
from tpdiag.cli.compare import compare, confirm_cmd
from tpdiag.cli.rollout import rollout
from tpdiag.cli.verdicts import diff, gate, report
from tpdiag.errors import TpdiagError

# Help is click's plain text everywhere: rich's panels cut a long choice or path off with '...'
# at any width. H.Group lists each command's whole first sentence, and H.help_width wraps at
# the terminal's width - or, piped, not at all, so no sentence is broken mid-line.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, cls=H.Group, context_settings=H.help_width(),
                  help="Find the first op whose output changes with the tensor-parallel degree.")


def _print_version(value: bool) -> None:
    if value:
        import tpdiag

        sys.stdout.write(f"tpdiag {tpdiag.__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                                help="print the installed version and exit")] = False) -> None:
    pass


# the commands, in the order `tpdiag --help` lists them; each group's options and rendering live
# in its own module (compare.py, rollout.py, verdicts.py)
app.command()(compare)
app.command()(rollout)
app.command(name="confirm")(confirm_cmd)


@app.command()
def fixes(fmt: Format = "text") -> None:
    """The fix catalogue: name, what it fixes, cost."""
    from tpdiag.fixes.registry import catalogue

    try:
        fmt = check_format(fmt)
    except TpdiagError as e:
        fail(e)
    rows = [f.to_dict() for f in catalogue().values()]
    if fmt == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    from tpdiag.cli.tables import fixes_table

    fixes_table(console(), rows)


@app.command()
def doctor(fmt: Format = "text") -> None:
    """Backend, devices, determinism-relevant environment, versions."""
    from tpdiag.cli.doctor import collect

    try:
        fmt = check_format(fmt)
    except TpdiagError as e:
        fail(e)
    info = collect()
    if fmt == "json":
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return
    from tpdiag.cli.tables import doctor_report
    from tpdiag.cli.doctor import assess

    doctor_report(console(), assess(info))


app.command()(report)
app.command()(gate)
app.command()(diff)


def main() -> None:
    import click

    from tpdiag.cli.common import quiet_closed_pipe

    quiet_closed_pipe()
    try:
        # standalone_mode=False: click's usage errors come here (one line, below), not as
        # click's multi-line usage box.
        rv = app(standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except click.exceptions.NoArgsIsHelpError as e:
        e.show()
        sys.exit(2)
    except click.UsageError as e:
        msg = " ".join(e.format_message().split())
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        sys.stderr.write(f"error: {msg}{hint}\n")
        sys.exit(e.exit_code)
    except click.ClickException as e:
        sys.stderr.write(f"error: {' '.join(e.format_message().split())}\n")
        sys.exit(e.exit_code)
    except click.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except SystemExit:
        raise
    except BrokenPipeError:
        # a write past the wrapper (click's own output): the reader is gone, nothing is wrong here
        sys.stdout._closed() if hasattr(sys.stdout, "_closed") else None
        sys.exit(0)
    except BaseException as e:  # last resort: never a bare traceback without --debug
        if isinstance(e, KeyboardInterrupt):
            sys.exit(130)
        if DEBUG["on"]:
            raise
        from tpdiag.cli.common import words_for

        sys.stderr.write(f"error: {words_for(e)}\n")
        sys.exit(2)

