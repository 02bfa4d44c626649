"""Container entry point: torchrun's elastic agent, with exit codes that keep their meaning.

`torchrun` exits 1 whenever any worker fails, so a preempted worker (143) or a killed one (137)
would look like a permanent error to a PyTorchJob with `restartPolicy: ExitCode`, and a retryable
failure would never be retried. This runs the same agent in-process (same arguments as torchrun)
and turns the workers' exit codes into the container's: a permanent code (1-127) from any worker
wins, since its peers only died because of it; otherwise SIGTERM becomes 143 and death by another
signal 128+signal, all retryable.

    python -m trainingrun_trainer.launch [torchrun options] --module trainingrun_trainer
"""
from __future__ import annotations

import signal
import sys
from typing import Iterable, Optional, Sequence

from . import exit_codes


def container_exit_code(worker_codes: Iterable[int]) -> int:
    """One exit code for the container from its failed workers' exit codes, first failure first.

    A permanent code from any worker wins (its peers only died because of it); otherwise the first
    failure is the root cause (the others were stopped by the agent): SIGTERM or 143 becomes 143
    (preemption), death by another signal 128+signal (137 for SIGKILL, e.g. the OOM killer).
    """
    codes = list(worker_codes)
    permanent = [c for c in codes if exit_codes.is_permanent(c)]
    if permanent:
        return permanent[0]
    for code in codes:
        if code == -signal.SIGTERM:
            return exit_codes.PREEMPTED
        if code < 0:
            return 128 + (-code)
        if code >= 128:
            return min(code, 255)
    return exit_codes.RETRYABLE


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(argv) if argv is not None else sys.argv[1:]))
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        failures = sorted(error.failures.values(), key=lambda failure: failure.timestamp)
        codes = [failure.exitcode for failure in failures]
        code = container_exit_code(codes)
        print(f"trainingrun launch: worker exit codes {codes} (first failure first) -> exit {code}", file=sys.stderr)
        return code
    except SignalException as error:
        # The agent got SIGTERM/SIGINT itself (pod deletion, Ctrl-C) and has stopped the workers.
        print(f"trainingrun launch: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return 128 + int(error.sigval)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
