"""Showing a local run's progress: a live bar on terminals, plain lines elsewhere."""

from __future__ import annotations

import time
from typing import Any, TextIO

from .runner import LocalRunner


class PlainDisplay:
    """Log lines for pipes and CI: one when the step moves by a tenth of the run or 10 s pass."""

    def __init__(self, out: TextIO):
        self.out, self.last_step, self.last_time = out, -1, 0.0

    def __call__(self, runner: LocalRunner, status: dict) -> None:
        progress = status.get("progress", {})
        step, total = progress.get("step"), progress.get("totalSteps")
        if step is None or step == self.last_step:
            return
        now = time.monotonic()
        if total and step - self.last_step < max(1, total // 10) and now - self.last_time < 10 and step != total:
            return
        self.last_step, self.last_time = step, now
        loss, rate = progress.get("loss"), progress.get("samplesPerSecond")
        print(
            f"{runner.attempt_label()} step {step}/{total} loss {'-' if loss is None else f'{loss:.4f}'} "
            f"samples/s {'-' if rate is None else f'{rate:.1f}'}",
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        pass


class RichDisplay:
    """A live progress bar for terminals: step/total, loss, samples/s, ETA, attempt."""

    def __init__(self, out: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.fields[attempt]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TimeRemainingColumn(),
            console=Console(file=out),
        )
        self.task: Any = None  #: rich's TaskID, once the total is known
        self.progress.start()

    def __call__(self, runner: LocalRunner, status: dict) -> None:
        progress = status.get("progress", {})
        total = progress.get("totalSteps") or runner.spec.trainer.max_steps
        if self.task is None:
            self.task = self.progress.add_task("train", total=total, attempt=runner.attempt_label(), loss="-", rate="-")
        loss = progress.get("loss")
        self.progress.update(
            self.task,
            completed=progress.get("step") or 0,
            total=total,
            attempt=runner.attempt_label(),
            loss="-" if loss is None else f"{loss:.4f}",
            rate="-" if progress.get("samplesPerSecond") is None else f"{progress['samplesPerSecond']:.0f}",
        )

    def close(self) -> None:
        self.progress.stop()
