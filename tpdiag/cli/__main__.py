"""`python -m tpdiag.cli ...` = the `tpdiag` command."""
from tpdiag.cli.app import main

main()
