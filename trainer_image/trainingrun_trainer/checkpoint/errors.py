"""What a save or a load raises, and one line about any of it."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

#: What a save or a load may raise: DCP's CheckpointException derives from BaseException, not Exception, so it is
#: caught by name.
SAVE_ERRORS = (Exception, CheckpointException)


def describe_error(exc: BaseException) -> str:
    """One line about an error; for DCP's CheckpointException, the underlying error of each rank."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict):
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure_cause(failure)
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def failure_cause(failure: Any) -> Any:
    """The exception of one rank in a CheckpointException's failures (DCP keeps it with its traceback)."""
    return failure[0] if isinstance(failure, tuple) else failure


class CheckpointLoadError(Exception):
    """A committed checkpoint that cannot be loaded (its content, not its files, is wrong)."""


class StorageUnavailable(Exception):
    """The checkpoint storage could not be read (unreachable, refused, timed out): a later attempt may succeed."""


class PeersLost(RuntimeError):
    """A save could not commit because a collective with the other ranks failed: a peer worker is gone (killed,
    its node lost) or timed out. Training cannot go on with it either; a restart resumes from the newest commit."""
