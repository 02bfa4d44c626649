"""Experiment trackers: what rank 0 logs to the loggers of `spec.trainer.loggers`.

A slow or unreachable tracker must never cost a step: the training thread only puts records on a bounded queue
(`QUEUE_MAX`), and one background thread hands them to each tracker. A full queue drops the record (counted in
`dropped`, one warning); a tracker that raises is logged once and still gets the later records (it may recover).
`close()` waits a bounded time (`CLOSE_SECONDS`), so a hung tracker cannot hold the process at exit either.

One tracked run per TrainingRun, whatever the attempts and restarts: TensorBoard's event files under `logDir`
are reopened with `purge_step` at the first step after the checkpoint the run resumed from, so TensorBoard's readers
drop what an earlier attempt logged from there on and each step is shown once (a resumed run computes those steps
again, and with exact resume the same values).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any, Mapping, Optional, Sequence

from .config import LoggerConfig

log = logging.getLogger("trainingrun.tracking")

QUEUE_MAX = 1024
CLOSE_SECONDS = 10.0
_STOP = object()


class TensorBoard:
    """Scalars and the config as text, to event files under `log_dir` (torch's SummaryWriter)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.writer: Any = None

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Events an earlier attempt logged after this run's checkpoint are hidden from here on: no step twice.
        self.writer = SummaryWriter(self.log_dir, purge_step=step + 1 if step else None)
        self.writer.add_text("config", f"```json\n{json.dumps(config, indent=1, sort_keys=True)}\n```", step)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def backends_for(loggers: Sequence[LoggerConfig]) -> list[Any]:
    return [TensorBoard(logger.log_dir) for logger in loggers if logger.kind == "tensorboard"]


class Tracker:
    """The training thread's side: `start`, `metrics`, `close` only queue records; `backends` get them in order."""

    def __init__(self, backends: Sequence[Any], queue_max: int = QUEUE_MAX):
        self.backends = list(backends)
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(queue_max)
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._deliver, name="trainingrun-tracking", daemon=True)
        self._thread.start()

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        self._put(("start", step, config))

    def metrics(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        kept = {name: float(value) for name, value in values.items() if value is not None}
        if kept:
            self._put(("metrics", step, kept))

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        self._put(("close", 0, None), block_for=timeout)
        self._put(_STOP, block_for=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("a tracker did not finish within %.0f s; its last records may be missing", timeout)

    def _put(self, record: Any, block_for: float = 0.0) -> None:
        try:
            self._queue.put(record, timeout=block_for) if block_for else self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("the trackers fall behind (%d records queued): records are dropped, training goes on",
                            self._queue.maxsize)

    def _deliver(self) -> None:
        while (record := self._queue.get()) is not _STOP:
            kind, step, payload = record
            for number, backend in enumerate(self.backends):
                try:
                    if kind == "close":
                        backend.close()
                    else:
                        getattr(backend, kind)(step, payload)
                except Exception as error:  # noqa: BLE001 - a tracker's failure must not end training
                    if number not in self._failed:
                        self._failed.add(number)
                        log.warning("%s: %s failed (%s: %s); training goes on, later records are still sent",
                                    type(backend).__name__, kind, type(error).__name__, str(error).splitlines()[0]
                                    if str(error) else "")


class NullTracker:
    """Ranks other than 0, and runs without loggers."""

    dropped = 0

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        pass

    def metrics(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        pass

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        pass


def for_rank(loggers: Sequence[LoggerConfig], rank: int) -> Any:
    backends = backends_for(loggers) if rank == 0 else []
    return Tracker(backends) if backends else NullTracker()
