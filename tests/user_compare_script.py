"""A user's script driving tpdiag's command line from Python, at top level, unguarded.
Usage: python user_compare_script.py OUT_DIR"""
import sys

from tpdiag.cli import app

app(["compare", "--tp", "1,2", "--out", sys.argv[1], "--no-baseline", "--no-confirm", "--device", "cpu",
     "--format", "json"])
