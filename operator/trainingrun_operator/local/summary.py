"""What a local run prints when it ends: its outcome, where its time went, the checkpoint intervals chosen, its
startup and throughput, and the exit code `trainingrun local` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Summary:
    steps: int
    final_loss: Optional[float]
    attempts: int  #: launcher attempts, as the cluster's status.attempt counts PyTorchJobs
    restarts_in_place: int  #: worker groups torchrun restarted within an attempt
    lost_steps: int
    goodput: float
    wall_seconds: float
    outcome: str
    message: str = ""
    stop_signal: Optional[int] = None  #: the signal that interrupted the run
    #: This invocation's wall time by part (run_figures.time_breakdown), adding up to wall_seconds.
    breakdown: dict[str, float] = field(default_factory=dict)
    chaos_notes: list[str] = field(default_factory=list)  #: fault injection asked for that never happened
    #: With checkpoint.interval.steps: auto, the last interval rank 0 reported (status.checkpointInterval).
    checkpoint_interval: Optional[dict] = None
    #: The last throughput rank 0 reported: samples/s, model FLOP/s, MFU (status.progress; None: not reported).
    samples_per_second: Optional[float] = None
    model_flops_per_second: Optional[float] = None
    mfu: Optional[float] = None
    #: The run's wall time and productive seconds over every invocation of it (the ledger's): goodput's terms.
    run_wall_seconds: float = 0.0
    run_productive_seconds: float = 0.0
    #: The training processes' start-up by phase, summed over processes (progress_report.ProcessTime), first step included.
    startup: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 succeeded, 128 + the signal when interrupted (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 1 failed."""
        if self.outcome == "succeeded":
            return 0
        return 128 + self.stop_signal if self.outcome == "interrupted" and self.stop_signal else 1

    def breakdown_line(self) -> str:
        """`time: wall 61.2 s = productive 40.1 s (65.5%) + lost 1.2 s + ...`, every part of the breakdown. When the
        run had earlier invocations, the line is this one's and a second line gives goodput's terms over all of them,
        so the result's goodput is never a figure the time line contradicts."""
        parts = " + ".join(
            f"{name.replace('_', ' ')} {seconds:.1f} s"
            + (f" ({seconds / self.wall_seconds:.1%})" if name == "productive" and self.wall_seconds > 0 else "")
            for name, seconds in self.breakdown.items()
        )
        if self.run_wall_seconds <= self.wall_seconds + 0.05:
            return f"time: wall {self.wall_seconds:.1f} s = {parts}"
        return (
            f"time (this invocation): wall {self.wall_seconds:.1f} s = {parts}\n"
            f"goodput {self.goodput:.3f} over the whole run: productive {self.run_productive_seconds:.1f} s of "
            f"{self.run_wall_seconds:.1f} s wall, every invocation of it included"
        )

    def interval_line(self) -> Optional[str]:
        """`checkpoint interval (auto): 120 steps = 12.0 s ...`, when the trainer chose it."""
        chosen = self.checkpoint_interval
        if not chosen:
            return None

        def seconds(key: str, digits: int = 1) -> str:
            return "-" if chosen.get(key) is None else f"{chosen[key]:.{digits}f} s"

        parts = []
        if chosen.get("steps") is not None:
            parts.append(
                f"checkpoint interval (auto): {chosen['steps']} steps = {seconds('seconds')}; a save costs "
                f"{seconds('saveCostSeconds', 3)}, {chosen.get('failures', 0)} failure(s), one every "
                f"{seconds('secondsBetweenFailures')} (estimated); a failure loses {seconds('expectedLostSeconds')} "
                "of training on average"
            )
        if chosen.get("secondsBetweenPodLosses") is not None:
            storage = chosen.get("storageSteps")
            parts.append(
                f"storage interval (auto): {f'{storage} step' + 's' * (storage != 1) if storage else 'every checkpoint'}; a copy costs "
                f"{seconds('persistCostSeconds', 3)}, a pod loss every {seconds('secondsBetweenPodLosses')} (estimated)"
            )
        return "\n".join(parts) or None

    def startup_line(self) -> Optional[str]:
        """`start-up: imports 4.1 s + init 0.3 s + ... + first step 1.2 s = 7.0 s to the first steps`: the processes'
        start-up (the time: line's startup, less launching) with restore and first step, summed over processes."""
        if not self.startup:
            return None
        parts = " + ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in self.startup.items())
        return f"start-up: {parts} = {sum(self.startup.values()):.1f} s to the first steps of the training processes"

    def throughput_line(self) -> Optional[str]:
        """`throughput: 320.0 samples/s, 1.23 TFLOP/s, MFU 41.2%` as last reported; MFU `-` without a known GPU peak."""
        if self.samples_per_second is None:
            return None
        flops = f", {self.model_flops_per_second / 1e12:.3g} TFLOP/s" if self.model_flops_per_second else ""
        mfu = f", MFU {self.mfu:.1%}" if self.mfu is not None else (", MFU - (no GPU peak)" if flops else "")
        return f"throughput: {self.samples_per_second:.1f} samples/s{flops}{mfu}"

    def result_line(self) -> str:
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "nan"
        return (
            f"result: steps={self.steps} final_loss={loss} attempts={self.attempts} "
            f"restarts_in_place={self.restarts_in_place} lost_steps={self.lost_steps} goodput={self.goodput:.3f} wall_seconds={self.wall_seconds:.1f}"
        )
