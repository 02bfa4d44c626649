"""Saving on the training thread: staging a state and handing it to the checkpoint thread, which stages what the
training thread left to it (`copy_in_background`) (a part of `CheckpointStore`)."""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Union

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .layout import (
    EXTRA_ENTRY,
    CheckpointInfo,
    PendingSave,
    _describe,
    logger,
)
from .save_planner import ReusingSavePlanner
from .tier_staging import StagedFile, data_file_name, plain_tensors, stageable, tensors_of


@dataclass
class _SaveJob:
    step: int
    state: Any
    config_hash: str
    model_digest: Union[str, Callable[[Mapping[str, Any]], str]]
    started: float
    expected_bytes: int  # about what this rank writes (for the memory tier's room)
    logged: bool = False  # this rank already logged the failure
    later: Optional[dict] = None  # entries of the plain state the background thread stages before writing
    marks: list = field(default_factory=list)  # (phase, perf_counter at its end), for `last_save_phases`
    copied: Future = field(default_factory=Future)  # done when `later` is staged; its exception if that failed


def _plain(state: Mapping[str, Any]) -> dict:
    """`state` with Stateful objects replaced by their state_dict."""
    return {key: (value.state_dict() if isinstance(value, Stateful) else value) for key, value in state.items()}


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors (and byte strings) in a nested state."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(value) for value in tree)
    return len(tree) if isinstance(tree, bytes) else 0


class Saving:
    """CheckpointStore's `save`, `wait_copied` and `wait`, and the checkpoint thread's staging of what a save left to
    the background. State lives in `CheckpointStore.__init__`."""

    _pending: Optional[PendingSave]
    _copying: Optional[_SaveJob]
    _defer_state_dicts: Optional[bool]

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        extra: Optional[Mapping[str, Any]] = None,
        *,
        config_hash: str = "",
        model_digest: Union[str, Callable[[Mapping[str, Any]], str]] = "",
        blocking: bool = False,
        copy_in_background: Collection[str] = (),
    ) -> PendingSave:
        """Checkpoint ``state`` as ``<uri>/step-NNNNNNNN``; call on every rank.

        ``state``: a dict for DCP (tensors, DTensors, nested dicts, Stateful objects; use
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` for model + optimizer).
        ``extra``: this rank's own small state of plain values (RNG states...), saved as this rank's
        entry of the same DCP checkpoint (``extra-rank-<r>``). ``config_hash`` and ``model_digest``
        (see :func:`model_digest`) are recorded in the manifest as given ("" = not recorded); ``model_digest`` may be a
        function of the staged state, then rank 0 computes it in the background.

        Finishes the previous save first, then stages (copies) state and extra and returns; the
        write and commit run in the background unless ``blocking``. Never raises a storage error:
        a failed save returns a handle whose ``result()`` is None and counts in ``failed_saves``.

        ``copy_in_background``: keys of ``state`` whose tensors the caller leaves unchanged until it calls
        :meth:`wait_copied` (the trainer: model, optimizer and EMA, which only the next optimizer step changes).
        The background thread copies them while training goes on, and after the first such save (which shows them
        to be plain, unsharded tensors) also takes their state_dict(): leave their structure unchanged too.
        """
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")
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
        deferred = (
            [key for key in copy_in_background if key in state] if not blocking and self._defer_state_dicts else []
        )
        plain = _plain({key: value for key, value in state.items() if key not in deferred})
        expected_bytes = self.last_save_bytes or tensor_bytes(plain)
        later = (
            {}
            if blocking
            else {key: state[key] if key in deferred else plain.pop(key) for key in copy_in_background if key in state}
        )
        if later and self._defer_state_dicts is None:
            self._defer_state_dicts = plain_tensors(later)
        staged = self._stage(plain)
        buffer = io.BytesIO()
        torch.save(dict(extra or {}), buffer)
        staged[EXTRA_ENTRY.format(rank=self.rank)] = buffer.getvalue()
        job = _SaveJob(
            step=step,
            state=staged,
            config_hash=config_hash,
            model_digest=model_digest,
            started=started,
            expected_bytes=expected_bytes,
            later=later or None,
        )
        if not later:
            job.copied.set_result(None)
        if blocking:
            future: Future = Future()
            future.set_result(self._run(job))
        else:
            future = self._executor.submit(self._run, job)
        self.last_blocking_seconds = time.perf_counter() - began
        pending = PendingSave(step, future, self.last_blocking_seconds)
        self._pending, self._copying = pending, job
        return pending

    def _stage(self, plain: dict) -> dict:
        return self._state_stager.stage(plain)

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
        self.last_blocking_seconds += waited
        if self._pending is not None:  # the save whose copy this was: set together in save(), wait() keeps the order
            self._pending.blocking_seconds += waited
        if error is not None:
            raise error
        return waited

    def wait(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, if any, and return the most recent save's outcome: the
        committed :class:`CheckpointInfo`, or None if it failed (or nothing was saved yet)."""
        self.wait_copied()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last_result = pending.result()
        return self._last_result

    def _take_later(self, job: _SaveJob) -> None:
        """Take the state_dict() of what save() left to the background (`job.later`), raising to the training thread
        (wait_copied) what that raises, as save() would have."""
        try:
            job.later = _plain(job.later or {})
        except BaseException as exc:
            job.later = None
            job.copied.set_exception(exc)
            raise

    def _stage_later(
        self, job: _SaveJob, tier_dir: Optional[str], planner: Optional[ReusingSavePlanner] = None
    ) -> Optional[StagedFile]:
        """Stage the entries save() left to the background (`copy_in_background`), then tell the training thread it
        may change them. Into this rank's data file in `tier_dir` when they are CPU or CUDA tensors (stage once,
        `tier_staging`; returned), else by the stager. With `planner` (set up by its `repeats`), only the tensors this
        rank's last plan writes go into the file, and rank 0 copies what its model digest reads besides."""
        later, job.later = job.later, None
        if not later:  # save() told the training thread
            return None
        staged: Optional[StagedFile] = None
        try:
            if tier_dir is not None and stageable(later):
                staged = StagedFile(os.path.join(tier_dir, data_file_name(self.rank)))
                try:
                    if planner is None:
                        job.state.update(staged.stage(later))
                    else:
                        job.state.update(staged.stage(later, planner.planned_tensors(), self._digest_reads(job, later)))
                except OSError as exc:
                    logger.warning(
                        "checkpoint step %d: rank %d cannot stage its state in %s (%s): this save %s",
                        job.step,
                        self.rank,
                        tier_dir,
                        _describe(exc),
                        "fails" if planner is not None else "commits to storage",
                    )
                    staged.failed = True
                    staged.close()
            if staged is None or (staged.failed and planner is None):  # not stageable, or staged to commit to storage
                job.state.update(self._stage(later))
        except BaseException as exc:  # the training thread raises it (wait_copied), as save() would have
            job.copied.set_exception(exc)
            if staged is not None:
                staged.close()
            raise
        job.copied.set_result(None)
        return staged

    def _digest_reads(self, job: _SaveJob, later: dict) -> list:
        """The tensors of `later` rank 0's model digest reads: those of its `entry` (`DigestOfEntry`), else all."""
        if self.rank != 0 or not callable(job.model_digest):
            return []
        entry = getattr(job.model_digest, "entry", None)
        return tensors_of(later if entry is None else later.get(entry, {}))
