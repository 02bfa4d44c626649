"""Where a training process's time goes (`progress_report.ProcessTime`), on rank 0's clock: the parts of the goodput
breakdown a process can see. The trainer adds to it as it goes and reports it with its progress; the supervisor
(the operator, `trainingrun local`) adds what happens outside processes (launching, rendezvous, backoff)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from trainingrun_api.progress_report import ProcessTime

_IMPORTED = time.monotonic()

#: The kinds of time a process adds up.
KINDS = ("startup", "restore", "checkpoint", "data_wait", "compute", "eval", "hang")
#: The parts of "startup", in order (`ProcessClock.mark`): interpreter start and imports; seeding, CUDA and the
#: process group; building the model and optimizer (and wrapping it for torch.compile); building the data; and the
#: rest before training (the checkpoint store, the trackers). Restoring is a kind of its own; the first step, where
#: torch.compile compiles and CUDA warms up, is compute, and `first_step` apart.
STARTUP_PHASES = ("imports", "init", "model", "data", "prepare")


def _stat_field(pid: int | str, index: int) -> int:
    """Field `index` of /proc/<pid>/stat counted after the command name (whose parentheses may hold spaces); 0 where
    unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rpartition(")")[2].split()[index])
    except (OSError, ValueError, IndexError):
        return 0


def start_ticks(pid: int | str = "self") -> int:
    """When a process started, in clock ticks since boot (Linux's /proc; the pair (pid, start) names one process, as
    a pid is reused); 0 where unknown."""
    return _stat_field(pid, 19)


def parent_pid(pid: int | str) -> int:
    """A process's parent (Linux's /proc); 0 where unknown."""
    return _stat_field(pid, 1)


def process_started() -> float:
    """time.monotonic() at which this process started (Linux: from /proc, so imports count); elsewhere, when this
    module was imported."""
    ticks = start_ticks()
    try:
        if not ticks:
            raise OSError("no start time")
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    age = since_boot - ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, min(age, time.monotonic()))


class ProcessClock:
    """Seconds of each kind this process spent, since it started."""

    def __init__(self, pod_name: str, now: Callable[[], float] = time.monotonic):
        self._now = now
        self.started = process_started() if now is time.monotonic else now()
        started_at = time.time() - (now() - self.started)
        self.process = f"{pod_name}/{os.getpid()}/{started_at:.0f}"
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.restored_productive_seconds = 0.0
        self.startup_phases = dict.fromkeys(STARTUP_PHASES, 0.0)
        self.first_step = 0.0  #: seconds of the first step (compile, warm-up), 0 until it ran
        self.trained_samples = 0  #: by its steps over all ranks, kept or lost
        self._marked = self.started
        self.phase = ""  #: the kind `timing` is timing now ("" when none): the hang watch's long phases
        self.phase_ended = -float("inf")  #: when the last `timing` ended (this clock's time)

    def mark(self, phase: str) -> None:
        """`phase` of start-up (`STARTUP_PHASES`) ends now: it took the time since the previous mark (the first: since
        the process started), restoring excluded."""
        now = self._now()
        self.startup_phases[phase] += max(0.0, now - self._marked)
        self._marked = now

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += max(0.0, seconds)

    @contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        began = self._now()
        outermost = not self.phase
        if outermost:
            self.phase = kind
        try:
            yield
        finally:
            ended = self._now()
            self.add(kind, ended - began)
            if outermost:
                self.phase, self.phase_ended = "", ended

    def recount(self, seconds: float, counted_as: str, really: str) -> float:
        """Time first counted as `counted_as` and since known to be `really` (at most what `counted_as` holds):
        returns the seconds moved."""
        moved = min(max(0.0, seconds), self.seconds[counted_as])
        self.seconds[counted_as] -= moved
        self.seconds[really] += moved
        return moved

    def ready(self) -> None:
        """Ready to train: the time since the process started that restoring did not take was startup; what the marks
        did not name of it is "prepare"."""
        self.seconds["startup"] = max(0.0, self._now() - self.started - self.seconds["restore"])
        named = sum(seconds for phase, seconds in self.startup_phases.items() if phase != "prepare")
        self.startup_phases["prepare"] = max(0.0, self.seconds["startup"] - named)

    def first_step_done(self, seconds: float) -> str:
        """The first step took `seconds`; the line that says where the time to it went (the parts add up)."""
        self.first_step = seconds
        parts = self.snapshot().startup_parts()
        return f"start-up {sum(parts.values()):.2f} s to the first step: " + ", ".join(
            f"{name.replace('_', ' ')} {value:.2f} s" for name, value in parts.items()
        )

    def snapshot(self) -> ProcessTime:
        s = self.seconds
        startup: dict[str, Any] = {f"{phase}_seconds": round(self.startup_phases[phase], 3) for phase in STARTUP_PHASES}
        return ProcessTime.model_construct(  # unchecked: reporting never raises in the training loop
            process=self.process,
            alive_seconds=round(self._now() - self.started, 3),
            startup_seconds=round(s["startup"], 3),
            restore_seconds=round(s["restore"], 3),
            checkpoint_seconds=round(s["checkpoint"], 3),
            data_wait_seconds=round(s["data_wait"], 3),
            compute_seconds=round(s["compute"], 3),
            eval_seconds=round(s["eval"], 3),
            hang_seconds=round(s["hang"], 3),
            trained_samples=float(self.trained_samples),
            restored_productive_seconds=round(self.restored_productive_seconds, 3),
            **startup,
            first_step_seconds=round(self.first_step, 3),
        )
