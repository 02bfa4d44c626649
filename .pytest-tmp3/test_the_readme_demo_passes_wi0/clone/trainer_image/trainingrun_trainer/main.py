"""Entry point: read the contract and the config, check everything that can be checked before any
process group exists, then train. Every failure ends in an exit code that tells the operator (or
`trainingrun local`) whether retrying can help; see `exit_codes`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Optional, Sequence

from trainingrun_api import exit_codes
from trainingrun_api.config import RunConfig

from .context import ContextError, RunContext

log = logging.getLogger("trainingrun.trainer")


def preflight(config: RunConfig, device_type: str) -> None:
    """Checks that need no process group: classes import, arguments fit, the libraries of optional features are
    installed, precision runs here."""
    from trainingrun_api import components

    from . import precision

    for component, field, extra in components.named_classes(config.trainer):
        components.check(component, field, **extra)
    components.check_libraries(config.trainer)
    precision.check_supported(config.trainer.precision, device_type)


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        context = RunContext.from_env()
    except ContextError as error:
        print(f"trainingrun-trainer: {error}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    configure_logging(context.rank)

    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        config = context.load_config()
        preflight(config, device_type)
    except ValueError as error:  # ConfigError and the precision checks
        log.error("%s", error)
        print(f"trainingrun-trainer: {error}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR

    from trainingrun_api.model_base import ConfigError

    from .checkpoint import CheckpointLoadError, StorageUnavailable
    from .shards import DataError
    from .trainer import Trainer

    trainer: Optional[Trainer] = None
    try:
        trainer = Trainer(config, context, device_type)
        code = trainer.run()
    except (ConfigError, DataError) as error:  # what the dataset found when built or read: fix the data or spec
        log.error("%s", error)
        print(f"trainingrun-trainer: {error}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    except CheckpointLoadError as error:
        log.error("%s", error)
        print(f"trainingrun-trainer: {error}; {_load_error_fix(str(error))}", file=sys.stderr)
        return exit_codes.CHECKPOINT_REFUSED
    except StorageUnavailable as error:
        # A storage outage at start must not end the run: the attempt is retried after the backoff.
        log.error("%s; exiting %d so the attempt is retried", error, exit_codes.RETRYABLE)
        print(
            f"trainingrun-trainer: {error}; retrying: check the storage endpoint and credentials if this repeats",
            file=sys.stderr,
        )
        exit_now(exit_codes.RETRYABLE)
    except Exception as error:
        if not peer_failure(error):
            raise
        # Not this worker's fault: retrying can help, so it must not read as a permanent exit 1.
        # The step says what the restart will throw away: the steps after the checkpoint it resumes from.
        log.error(
            "a peer worker is gone%s (%s); exiting %d so the attempt is retried",
            f" after step {trainer.step}" if trainer is not None else "",
            str(error).splitlines()[0][:200],
            exit_codes.RETRYABLE,
        )
        # At once: the process group is broken and a save in flight can never commit, and a normal
        # interpreter exit waits on those threads for about a second that the restart then lacks.
        exit_now(exit_codes.RETRYABLE)
    return code


def exit_now(code: int) -> NoReturn:
    """Flush the logs and the standard streams, then end the process without the interpreter's teardown.

    How a trainer process ends once `main` returned: everything is written by then (the checkpoint store
    and the reporter closed, the process groups destroyed). In the interpreter's teardown gloo's C++
    threads (most likely those FSDP2's device mesh still references) were seen to abort a finished
    worker ("terminate called without an active exception", exit -6) in about one CI run in several:
    a successful run would read as a failed attempt.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def peer_failure(error: BaseException) -> bool:
    """Whether a collective failed because another worker died (killed, OOM, preempted)."""
    import torch.distributed as dist

    from .checkpoint import PeersLost

    if isinstance(error, (dist.DistError, PeersLost)):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and any(
        sign in message for sign in ("Connection reset by peer", "Connection closed by peer", "gloo/transport")
    )


def _load_error_fix(error: str) -> str:
    """What to do about a checkpoint that cannot be loaded. Moving it aside helps a damaged one, not one saved from
    another model: every older checkpoint of the run has the same shapes."""
    if "size mismatch" in error.lower() or "shape" in error.lower():
        return (
            "the model changed since the run's checkpoints were saved, and older ones have the same shapes: start a "
            "new run on another checkpoint.uri (trainingrun local: --checkpoint-uri, or delete runs/<name>)"
        )
    return "move that checkpoint directory aside to resume from an older one"
