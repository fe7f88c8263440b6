"""`python -m gemma4serve` = the `gemma4serve` command."""

import sys

from gemma4serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
