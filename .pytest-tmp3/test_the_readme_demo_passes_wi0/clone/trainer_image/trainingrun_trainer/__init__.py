"""trainingrun_trainer: the in-pod training runtime of trainingrun-operator, and a small library.

`python -m trainingrun_trainer` runs the built-in trainer under torchrun. A script with its own loop
uses `Run` (checkpoint store, resume, preemption, status reporting) the same way; see
examples/custom_loop.py. Its config models, the contract with the operator and the exit codes live in the
torch-free `trainingrun_api`, which the operator imports too.
"""

__version__ = "0.1.0"

__all__ = ["Run", "CheckpointStore", "RunContext", "model_digest", "init_process_group"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for its config models) must not import torch.
    if name in ("Run", "init_process_group"):
        from . import session

        return getattr(session, name)
    if name in ("CheckpointStore", "model_digest"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name == "RunContext":
        from .context import RunContext

        return RunContext
    raise AttributeError(f"module 'trainingrun_trainer' has no attribute {name!r}")
