"""`python -m tpdiag.cli ...` = the `tpdiag` command."""
import os
import sys

# `python -m` puts the working directory first on sys.path, which the user did not ask for: a
# torch/ there would be imported in place of torch (tpdiag/__main__.py says the same). Dropped
# before anything imports torch; PYTHONPATH's entries, the user's own choice, stay.
if sys.path and not sys.flags.safe_path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from tpdiag.cli.app import main  # noqa: E402

main()
