"""A module for tests/test_procs.py: `python -m tests.rank_probe_module ARGS` prints how it was run."""

import sys

if __name__ == "__main__":
    print("module", __name__, sys.argv[1:])
