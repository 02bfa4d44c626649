"""What `Run` tells the operator and the launcher (session.py): progress reports from rank 0, and each committed
checkpoint, in storage and in node memory."""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

from trainingrun_api.progress_report import CheckpointInMemory, CommittedCheckpoint, Progress

from .checkpoint import CheckpointInfo, PendingSave, now_rfc3339
from .timekeeping import ProcessClock

log = logging.getLogger("trainingrun.session")


class RunReports:
    """Part of `Run`: reports to the operator and the launcher."""

    _pending: Optional[PendingSave]

    def report_committed(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight (the next save waits for it anyway) and report the newest checkpoint in storage
        as lastGoodCheckpoint (persisting behind, the one committed now may still be on its way there: it is
        checkpointInMemory)."""
        info = self.store.wait()
        self._pending = None
        if info is not None:
            self.last_committed = info
        self._report_stored()
        return info

    def _report_stored(self) -> None:
        """Tell the reporter the newest checkpoints in storage and (persisting behind) in memory, when they changed;
        cheap enough for every step."""
        stored, in_memory = self.store.in_storage, self.store.in_memory
        if self.store.persist_behind and in_memory is not None and in_memory is not self._reported_in_memory:
            self._reported_in_memory = in_memory
            self.reporter.committed_in_memory(
                CheckpointInMemory.model_construct(step=in_memory.step, time=in_memory.time)
            )
        if stored is not None and stored is not self._reported and stored != self._reported:
            self._reported = stored
            self.reporter.committed(
                CommittedCheckpoint.model_construct(
                    uri=stored.uri, step=stored.step, time=stored.time, sha256=stored.manifest_sha256
                )
            )

    def _tell_launcher(self, info: Optional[CheckpointInfo]) -> None:
        """Progress the launcher's agent can see, written the moment a save commits (on the thread that committed
        it, not at the next report: a worker killed a few steps later has made it): a group that committed a step
        gets its in-place restart budget back."""
        path = self.context.committed_step_file
        if info is None:
            return
        try:
            partial = f"{path}.partial"
            with open(partial, "w", encoding="utf-8") as out:
                out.write(str(info.step))
            os.replace(partial, path)
        except OSError as error:  # the budget then refills less often: never worth failing a step
            log.warning("could not record committed step %d for the launcher at %s: %s", info.step, path, error)

    def report(
        self,
        step: int,
        *,
        total_steps: Optional[int] = None,
        loss: Optional[float] = None,
        samples_per_second: Optional[float] = None,
        productive_seconds: Optional[float] = None,
        process_time: Optional[ProcessClock] = None,
        model_flops_per_second: Optional[float] = None,
        mfu: Optional[float] = None,
    ) -> None:
        """Report progress, and where this process's time went (rank 0 only; never blocks, never raises; sent at
        the reporter's pace)."""
        if not self.reporter.enabled:
            return  # every step: ranks that do not report build nothing
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
            ),
            process_time.snapshot() if process_time is not None else None,
            self.interval_choice(),
        )
