"""`python -m mtpipe`: the `mtpipe` command."""

import sys

from .coordinator.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
