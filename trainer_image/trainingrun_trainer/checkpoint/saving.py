"""`Saver`, the training thread's side of a save: staging a state and handing it to the checkpoint thread
(`committing.Committer`), and waiting for it."""

from __future__ import annotations

import io
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Optional

import torch

from .committing import Committer, plain_state
from .context import StoreContext
from .errors import PeersLost, describe_error
from .layout import EXTRA_ENTRY
from .records import CheckpointInfo, PendingSave, SaveJob, SaveOptions
from .tier_staging import plain_tensors


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors (and byte strings) in a nested state."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(value) for value in tree)
    return len(tree) if isinstance(tree, bytes) else 0


class Saver:
    """`save`, `wait_copied` and `wait`: one save in flight at a time, run by `committer` on the checkpoint thread."""

    def __init__(self, context: StoreContext, committer: Committer):
        self._context = context
        self._committer = committer
        #: The checkpoint thread: one, reused across saves, so fsspec's sessions are reused.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-checkpoint")
        self._pending: Optional[PendingSave] = None
        self._copying: Optional[SaveJob] = None  # the save whose background copy the caller has not waited for
        self._committing: Optional[SaveJob] = None  # the save in flight (`wait_committed`)
        self._last_result: Optional[CheckpointInfo] = None
        self._defer_state_dicts: Optional[bool] = None  # see save(); decided by the first save that copies later

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        extra: Optional[Mapping[str, Any]] = None,
        options: SaveOptions = SaveOptions(),
    ) -> PendingSave:
        """Checkpoint ``state`` as ``<uri>/step-NNNNNNNN``; call on every rank.

        ``state``: a dict for DCP (tensors, DTensors, nested dicts, Stateful objects; use
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` for model + optimizer).
        ``extra``: this rank's own small state of plain values (RNG states...), saved as this rank's
        entry of the same DCP checkpoint (``extra-rank-<r>``). ``options``: `SaveOptions`, field by field.

        Finishes the previous save first, then stages (copies) state and extra and returns; the
        write and commit run in the background unless ``options.blocking``. Never raises a storage error:
        a failed save returns a handle whose ``result()`` is None and counts in ``failed_saves``.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        began = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        reserved = [key for key in state if str(key).startswith(EXTRA_ENTRY.format(rank=""))]
        if reserved:
            raise ValueError(f"state keys {reserved} are reserved for each rank's extra state: rename them")
        # The background thread also takes the state_dict() of what it copies, once the first save has shown them to
        # be plain tensors (not sharded: gathering those may be a collective, which only the training thread may run):
        # torch's get_state_dict walks every module and parameter, milliseconds per save, more the larger the model,
        # and nothing it reads changes before the optimizer step.
        blocking, copy_in_background = options.blocking, options.copy_in_background
        deferred = (
            [key for key in copy_in_background if key in state] if not blocking and self._defer_state_dicts else []
        )
        plain = plain_state({key: value for key, value in state.items() if key not in deferred})
        expected_bytes = self._context.metrics.last_save_bytes or tensor_bytes(plain)
        later = (
            {}
            if blocking
            else {key: state[key] if key in deferred else plain.pop(key) for key in copy_in_background if key in state}
        )
        if later and self._defer_state_dicts is None:
            self._defer_state_dicts = plain_tensors(later)
        staged = self._committer.stage(plain)
        buffer = io.BytesIO()
        torch.save(dict(extra or {}), buffer)
        staged[EXTRA_ENTRY.format(rank=self._context.ranks.rank)] = buffer.getvalue()
        job = SaveJob(
            step=step,
            state=staged,
            config_hash=options.config_hash,
            model_digest=options.model_digest,
            started=started,
            expected_bytes=expected_bytes,
            later=later or None,
        )
        if not later:
            job.copied.set_result(None)
        if blocking:
            future: Future = Future()
            future.set_result(self._committer.run(job))
        else:
            future = self.executor.submit(lambda: self._committer.run(job))
        self._context.metrics.last_blocking_seconds = time.perf_counter() - began
        pending = PendingSave(step, future, self._context.metrics.last_blocking_seconds)
        self._pending, self._copying, self._committing = pending, job, job
        return pending

    def wait_copied(self) -> float:
        """Wait until the save in flight has copied its ``copy_in_background`` entries; returns the seconds waited
        (they count in ``last_blocking_seconds`` and the save's ``blocking_seconds``). Call it before changing
        them. Raises what copying raised (out of memory...), as ``save()`` would have."""
        job, self._copying = self._copying, None
        if job is None:
            return 0.0
        began = time.perf_counter()
        error = job.copied.exception()
        waited = time.perf_counter() - began
        self._context.metrics.last_blocking_seconds += waited
        if self._pending is not None:  # the save whose copy this was: set together in save(), wait() keeps the order
            self._pending.blocking_seconds += waited
        if error is not None:
            raise error
        return waited

    def wait_committed(self) -> float:
        """Wait until the save in flight, if any, committed or failed; returns the seconds waited (counted as
        `wait_copied`'s are). Raises `PeersLost` when it failed because a collective with the other ranks did (a
        peer is gone): a step taken now would be thrown away by the restart, which resumes from the commit before."""
        job, self._committing = self._committing, None
        if job is None:
            return 0.0
        began = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - began
        self._context.metrics.last_blocking_seconds += waited
        if job.lost_contact is not None:
            raise PeersLost(
                f"checkpoint step {job.step} could not commit: {describe_error(job.lost_contact)}"
            ) from job.lost_contact
        return waited

    def wait(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, if any, and return the most recent save's outcome: the
        committed :class:`CheckpointInfo`, or None if it failed (or nothing was saved yet)."""
        self.wait_copied()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last_result = pending.result()
        return self._last_result
