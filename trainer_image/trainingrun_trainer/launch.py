"""Container entry point: torchrun's elastic agent, with exit codes that keep their meaning.

`torchrun` exits 1 whenever any worker fails, so a preempted worker (143) or a killed one (137)
would look like a permanent error to a PyTorchJob with `restartPolicy: ExitCode`, and a retryable
failure would never be retried. This runs the same agent in-process (same arguments as torchrun)
and turns the workers' exit codes into the container's: a permanent code (1-127) from any worker
deliberately chosen by the trainer wins; a worker killed by a signal explains its peers' failures;
SIGTERM becomes 143 (see `container_exit_code`).

    python -m trainingrun_trainer.launch [torchrun options] --module trainingrun_trainer
"""
from __future__ import annotations

import signal
import sys
from typing import Iterable, Optional, Sequence

from . import exit_codes


def container_exit_code(worker_codes: Iterable[int]) -> int:
    """One exit code for the container from its failed workers' exit codes.

    Precedence, because peers of a failed worker fail too, as a consequence:
    1. a deliberate permanent code (2-127: bad config, divergence) from any worker;
    2. a worker killed by a signal other than SIGTERM (OOM killer, chaos): 128+signal, retryable;
       its peers then die in a broken collective with exit 1, which must not read as permanent;
    3. 143, a worker's deliberate exit after its emergency checkpoint (preemption): 143;
    4. 1 (an uncaught exception; peers killed by SIGTERM were only stopped by the agent): permanent;
    5. death by SIGTERM alone (a script without a handler, pod deletion): 143.
    """
    codes = list(worker_codes)
    for code in codes:
        if 2 <= code <= 127:
            return code
    for code in codes:
        if code < 0 and code != -signal.SIGTERM:
            return 128 + (-code)
        if code > 128 and code not in (exit_codes.PREEMPTED,):
            return min(code, 255)
    if exit_codes.PREEMPTED in codes:  # a worker checkpointed and exited on SIGTERM: preemption
        return exit_codes.PREEMPTED
    if 1 in codes:  # peers merely stopped by the agent (-15) do not explain an exception
        return 1
    if -signal.SIGTERM in codes:
        return exit_codes.PREEMPTED
    return exit_codes.RETRYABLE


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(argv) if argv is not None else sys.argv[1:]))
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        codes = [failure.exitcode for failure in error.failures.values()]
        code = container_exit_code(codes)
        print(f"trainingrun launch: worker exit codes {codes} -> exit {code}", file=sys.stderr)
        return code
    except SignalException as error:
        # The agent got SIGTERM/SIGINT itself (pod deletion, Ctrl-C) and has stopped the workers.
        print(f"trainingrun launch: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return 128 + int(error.sigval)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
