import sys

from benchmarks.cli import main

sys.exit(main(sys.argv[1:]))
