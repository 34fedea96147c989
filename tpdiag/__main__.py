"""`python -m tpdiag ...` = the `tpdiag` command (where the console script is not on PATH)."""
import os
import sys

# `python -m` puts the working directory first on sys.path, which the user did not ask for (the
# console script does not): a torch/ there would be imported in place of torch. Dropped here;
# PYTHONPATH's entries, the user's own choice, stay.
_cwd = sys.path[0] if sys.path and not sys.flags.safe_path and sys.path[0] in ("", os.getcwd()) else None
if _cwd is not None:
    del sys.path[0]

if getattr(sys.modules.get("tpdiag"), "__file__", None) is None:
    # A folder named tpdiag there (a clone's parent) became the package `tpdiag`, an empty
    # namespace, while this file came from the real one. Import the real package from where this
    # file lives.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _root)
    for _name in [m for m in sys.modules if m == "tpdiag" or m.startswith("tpdiag.")]:
        if _name != "tpdiag.__main__":
            del sys.modules[_name]

from tpdiag.cli.app import main  # noqa: E402

main()
