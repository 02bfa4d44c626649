"""`python -m trainingrun_trainer`: the trainer entry point (run it under torchrun)."""
import sys

from .main import main

sys.exit(main())
