"""`python -m tpdiag ...` = the `tpdiag` command (where the console script is not on PATH)."""
import os
import sys

if getattr(sys.modules.get("tpdiag"), "__file__", None) is None:
    # `python -m` puts the working directory first on sys.path: a folder named tpdiag there (a
    # clone's parent) became the package `tpdiag`, an empty namespace, while this file came from
    # the real one. Import the real package from where this file lives.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _root)
    for _name in [m for m in sys.modules if m == "tpdiag" or m.startswith("tpdiag.")]:
        if _name != "tpdiag.__main__":
            del sys.modules[_name]

from tpdiag.cli.app import main  # noqa: E402

main()
