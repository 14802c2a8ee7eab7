"""`python -m benchmarks`: the benchmark's command line (benchmarks/cli.py). Importing this module runs nothing."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
