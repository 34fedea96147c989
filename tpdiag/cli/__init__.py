"""The `tpdiag` command: wiring (app.py), shared options (common.py), option parsing (options.py),
rendering (render.py; progress.py the live status), `tpdiag rollout` (rollout.py) and `tpdiag doctor` (doctor.py).

The CLI is the only place that turns the library's typed errors into messages and exit codes,
and the only user of rich. Importing it loads typer, not torch."""
from tpdiag.cli.app import app, main

__all__ = ["app", "main"]
