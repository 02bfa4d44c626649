"""`RunReports`: what `Run` (session.py) tells the operator and the launcher: progress reports from rank 0, and each
committed checkpoint, in storage and in node memory."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Optional

from trainingrun_api.progress_report import (
    MAX_PODS_NAMED,
    CheckpointInMemory,
    CommittedCheckpoint,
    IntervalChoice,
    MemoryShort,
    Progress,
)

from .checkpoint import CheckpointInfo, CheckpointStore, now_rfc3339
from .reporting import ProgressReporter
from .timekeeping import ProcessClock

log = logging.getLogger("trainingrun.session")


class RunReports:
    """Reports `store`'s newest checkpoints and the run's progress through `reporter`; `committed_step_file`: where
    the launcher's agent reads the newest committed step ("" or None: nowhere)."""

    def __init__(self, reporter: ProgressReporter, store: CheckpointStore, committed_step_file: Optional[str]):
        self.reporter = reporter
        self._store = store
        self._committed_step_file = committed_step_file
        self._reported: Optional[CheckpointInfo] = None  # the newest in storage, as reported
        self._reported_in_memory: Optional[CheckpointInfo] = None  # persisting behind: the newest in memory
        self._reported_short: Optional[list[str]] = None  # the pods last reported short of memory

    def resumed(self) -> None:
        """The store found the run's checkpoints: lastGoodCheckpoint reports only those this process commits."""
        self._reported = self._store.in_storage

    def stored(self) -> None:
        """Tell the reporter the newest checkpoints in storage and (persisting behind) in memory, when they changed;
        cheap enough for every step."""
        stored, in_memory = self._store.in_storage, self._store.in_memory
        if self._store.persist_behind and in_memory is not None and in_memory is not self._reported_in_memory:
            self._reported_in_memory = in_memory
            self.reporter.committed_in_memory(
                CheckpointInMemory.model_construct(step=in_memory.step, time=in_memory.time)
            )
        short = self._store.memory_short
        if short is not None and short[1] != self._reported_short:
            self._reported_short = short[1]
            self.reporter.memory_short(MemoryShort.model_construct(pods=short[1][:MAX_PODS_NAMED], step=short[0]))
        if stored is not None and stored is not self._reported and stored != self._reported:
            self._reported = stored
            self.reporter.committed(
                CommittedCheckpoint.model_construct(
                    uri=stored.uri, step=stored.step, time=stored.time, sha256=stored.manifest_sha256
                )
            )

    def tell_launcher(self, info: Optional[CheckpointInfo]) -> None:
        """Progress the launcher's agent can see, written the moment a save commits (on the thread that committed
        it, not at the next report: a worker killed a few steps later has made it): a group that committed a step
        gets its in-place restart budget back."""
        path = self._committed_step_file
        if info is None or not path:
            return
        try:
            partial = f"{path}.partial"
            with open(partial, "w", encoding="utf-8") as out:
                out.write(str(info.step))
            os.replace(partial, path)
        except OSError as error:  # the budget then refills less often: never worth failing a step
            log.warning("could not record committed step %d for the launcher at %s: %s", info.step, path, error)

    def progress(
        self,
        step: int,
        *,
        total_steps: Optional[int],
        loss: Optional[float],
        samples_per_second: Optional[float],
        productive_seconds: Optional[float],
        process_time: Optional[ProcessClock],
        model_flops_per_second: Optional[float],
        mfu: Optional[float],
        interval_choice: Optional[IntervalChoice],
        evaluation: Optional[tuple[int, float]] = None,
    ) -> None:
        """Report progress, and where this process's time went (never blocks, never raises; sent at the reporter's
        pace; a reporter that is off builds nothing)."""
        if not self.reporter.enabled:
            return
        self.reporter.progress(
            Progress.model_construct(  # unchecked: reporting never raises in the training loop
                step=step,
                updated_at=now_rfc3339(),
                total_steps=total_steps,
                loss=loss if loss is not None and math.isfinite(loss) else None,
                samples_per_second=samples_per_second,
                productive_seconds=None if productive_seconds is None else round(productive_seconds, 3),
                model_flops_per_second=model_flops_per_second,
                mfu=None if mfu is None else round(mfu, 4),
                **_evaluation(evaluation),
            ),
            process_time.snapshot() if process_time is not None else None,
            interval_choice,
        )


def _evaluation(evaluation: Optional[tuple[int, float]]) -> dict[str, Any]:
    """Progress's eval_step and eval_loss from (step, loss), when the loss is a finite number."""
    if evaluation is None or not isinstance(evaluation[1], (int, float)) or not math.isfinite(evaluation[1]):
        return {}
    return {"eval_step": int(evaluation[0]), "eval_loss": float(evaluation[1])}
