"""`python -m nanoserve ...`: the same command line as `nanoserve ...` (cli.py)."""

import sys

from nanoserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
