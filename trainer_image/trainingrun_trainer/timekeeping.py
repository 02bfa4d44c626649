"""Where a training process's time goes (`contract.ProcessTime`), on rank 0's clock: the parts of the goodput
breakdown a process can see. The trainer adds to it as it goes and reports it with its progress; the supervisor
(the operator, `trainingrun local`) adds what happens outside processes (launching, rendezvous, backoff)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

from .contract import ProcessTime

_IMPORTED = time.monotonic()

#: The kinds of time a process adds up.
KINDS = ("startup", "restore", "checkpoint", "data_wait", "compute", "eval")


def process_started() -> float:
    """time.monotonic() at which this process started (Linux: from /proc, so imports count); elsewhere, when this
    module was imported."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    age = since_boot - ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, min(age, time.monotonic()))


class ProcessClock:
    """Seconds of each kind this process spent, since it started."""

    def __init__(self, pod_name: str):
        self.started = process_started()
        started_at = time.time() - (time.monotonic() - self.started)
        self.process = f"{pod_name}/{os.getpid()}/{started_at:.0f}"
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.restored_productive_seconds = 0.0

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += max(0.0, seconds)

    @contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(kind, time.monotonic() - began)

    def recount(self, seconds: float, counted_as: str, really: str) -> float:
        """Time first counted as `counted_as` and since known to be `really` (at most what `counted_as` holds):
        returns the seconds moved."""
        moved = min(max(0.0, seconds), self.seconds[counted_as])
        self.seconds[counted_as] -= moved
        self.seconds[really] += moved
        return moved

    def ready(self) -> None:
        """Ready to train: the time since the process started that restoring did not take was startup."""
        self.seconds["startup"] = max(0.0, time.monotonic() - self.started - self.seconds["restore"])

    def snapshot(self) -> ProcessTime:
        s = self.seconds
        return ProcessTime(
            process=self.process, alive_seconds=round(time.monotonic() - self.started, 3),
            startup_seconds=round(s["startup"], 3), restore_seconds=round(s["restore"], 3),
            checkpoint_seconds=round(s["checkpoint"], 3), data_wait_seconds=round(s["data_wait"], 3),
            compute_seconds=round(s["compute"], 3), eval_seconds=round(s["eval"], 3),
            restored_productive_seconds=round(self.restored_productive_seconds, 3))
