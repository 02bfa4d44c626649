"""`python -m trainingrun_operator [flags]` runs the operator, like `trainingrun operator [flags]`."""

import sys

from .cli import main

sys.exit(main(["operator", *sys.argv[1:]]))
