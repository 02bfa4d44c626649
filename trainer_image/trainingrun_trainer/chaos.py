"""`trainingrun local`'s faults, injected by the training processes themselves at a precise step (the options set
contract variables that RunContext reads): a worker that SIGKILLs itself, a node that stops, and the hangs that
hangs.py finds (a rank stopped, blocked before a collective, or whose data loader blocks), and a straggler
(stragglers.py)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from trainingrun_api import contract

from .context import RunContext

log = logging.getLogger("trainingrun.session")

#: Set by `--chaos-hang data:STEP`: the next batch this process reads never comes (`data_gate`).
_DATA_BLOCKED = threading.Event()


def block_forever() -> None:
    """What a hung rank does: waits for what never happens (the wait can only end with the process)."""
    threading.Event().wait()


def data_gate() -> None:
    """The data path's check before each batch: blocks for ever once `--chaos-hang data` fired in this process."""
    if _DATA_BLOCKED.is_set():
        log.warning("chaos: the data loader blocks")
        block_forever()


def slow_down(context: RunContext, own_seconds: float) -> float:
    """`--chaos-slow-rank FACTOR[:RANK]`: on that rank, before the step's first collective, wait (FACTOR - 1) x the
    time the step took so far, so its part takes FACTOR times as long and every other rank waits for it. The
    seconds waited (0 elsewhere)."""
    slow = context.chaos_slow_rank
    if slow is None or slow[1] != context.rank:
        return 0.0
    extra = (slow[0] - 1.0) * max(0.0, own_seconds)
    time.sleep(extra)  # the fault itself: a slower rank
    return extra


HANG_FIRED = contract.CHAOS_HANG_FIRED_FILE


def _first_hang(context: RunContext) -> bool:
    """Whether no worker group of this invocation hung by `--chaos-hang` yet (this call marks it so): a group
    restarted because a peer's failed does not count as restarted on its node (TORCHELASTIC_RESTART_COUNT 0), and
    would hang again at the same step."""
    try:
        os.close(os.open(os.path.join(os.path.dirname(context.config_path), HANG_FIRED), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError:  # no place for the mark: the restart count alone decides (context.chaos_hang)
        return True
    return True


def after_step(context: RunContext, step: int, make_durable: Callable[[], Any]) -> None:
    """The faults asked for at the end of `step` (nothing unless a chaos option asked): one worker SIGKILLs itself
    (--chaos-kill-step), the node's local rank 0 stops itself until every process of the node is killed
    (--chaos-lose-node: its peers lose it as a node failure loses a pod), or one rank hangs (--chaos-hang).
    `make_durable`: waits until earlier checkpoints are durable, so that a crash loses exactly the steps since the
    last one, whatever the machine's load."""
    kill = step == context.chaos_kill_at_step and context.rank == step % context.world_size
    lose = step == context.chaos_lose_node_at_step and context.local_rank == 0
    hang = context.chaos_hang is not None and context.chaos_hang.fires(step, context.rank, context.world_size)
    if hang and not _first_hang(context):
        hang = False
    if not (kill or lose or hang):
        return
    make_durable()
    if hang:
        kind = context.chaos_hang.kind if context.chaos_hang else ""
        log.warning("chaos: rank %d hangs after step %d (%s)", context.rank, step, kind)
        if kind == "data":
            _DATA_BLOCKED.set()
        elif kind == "block":
            block_forever()
        else:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kill:
        log.warning("chaos: SIGKILL worker rank %d at step %d", context.rank, step)
    else:
        log.warning("chaos: node lost at step %d (%s)", step, context.pod_name)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)
