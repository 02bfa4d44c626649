"""`python -m trainingrun_trainer`: the trainer entry point (run it under torchrun)."""

from .main import exit_now, main

exit_now(main())
