"""`python -m tpdiag ...` = the `tpdiag` command (where the console script is not on PATH)."""
from tpdiag.cli import main

main()
