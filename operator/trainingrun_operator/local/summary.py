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
    process_starts: int = 0  #: worker groups started in this invocation whose rank 0 reported (one process each)
    #: Samples over the steps' compute and data wait, every process of this invocation (None: none reported).
    average_samples_per_second: Optional[float] = None
    eval_loss: Optional[float] = None  #: at the last evaluation rank 0 reported (spec.trainer.eval)
    eval_step: Optional[int] = None
    #: Each hang's one-line diagnosis (`hang diagnosis:` in the trainer's log), in order.
    hangs: list[str] = field(default_factory=list)
    #: Each straggler rank 0 named (`slow rank:` in the trainer's log), in words, in order.
    slow_ranks: list[str] = field(default_factory=list)

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
            f"{_term(name)} {seconds:.1f} s"
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
        """`start-up 13.4 s = outside the training processes 12.4 s + imports 0.1 s + ... (rank 0's, 2 worker group starts); then
        restore 0.1 s and first steps 0.6 s`: the time line's start-up term, part by part (the time no training
        process was running, then the processes' own phases, summed over them), and what each process did next
        before training at speed, which the time line counts as restore and productive."""
        if not self.startup:
            return None
        phases = {name: seconds for name, seconds in self.startup.items() if name not in ("restore", "first_step")}
        total = self.breakdown.get("startup", sum(phases.values()))
        inside = " + ".join(f"{_term(name)} {seconds:.1f} s" for name, seconds in phases.items())
        return (
            f"start-up {total:.1f} s = outside the training processes {max(0.0, total - sum(phases.values())):.1f} s "
            f"(launching, rendezvous, ending) + {inside} (rank 0's, {self.process_starts} worker group start"
            f"{'s' * (self.process_starts != 1)}); then restore {self.startup.get('restore', 0.0):.1f} s and first "
            f"steps {self.startup.get('first_step', 0.0):.1f} s, in the time line's restore and productive"
        )

    def throughput_line(self) -> Optional[str]:
        """`throughput: 447.1 samples/s on average, 0.076 TFLOP/s, MFU - (no GPU peak); last reading 524.2 samples/s`:
        the average over every step's compute and data wait in this invocation (the last reading, one logging
        window, says little about a run that sped up or slowed down); the last reading alone where the processes
        did not count their samples (a loop of one's own that reports samples/s itself)."""
        last = self.samples_per_second
        average = self.average_samples_per_second
        if last is None and average is None:
            return None
        rate = average if average is not None else last
        assert rate is not None
        # Model FLOPs and MFU scale with samples/s: the last reading's, at the average.
        scale = rate / last if last else None
        flops = self.model_flops_per_second * scale if self.model_flops_per_second and scale else None
        mfu = self.mfu * scale if self.mfu is not None and scale else None
        figures = f"{rate:.1f} samples/s" + (f", {flops / 1e12:.3g} TFLOP/s" if flops else "")
        figures += f", MFU {mfu:.1%}" if mfu is not None else (", MFU - (no GPU peak)" if flops else "")
        if average is None:
            return f"throughput: {figures} (the last reading)"
        return f"throughput: {figures} on average" + (f"; last reading {last:.1f} samples/s" if last else "")

    def eval_line(self) -> Optional[str]:
        """`eval loss: 2.3145 at step 120`, the last evaluation's mean loss on the held-out split, when there was one."""
        if self.eval_loss is None:
            return None
        return f"eval loss: {self.eval_loss:.4f} at step {self.eval_step} (the held-out split's mean)"

    def hang_lines(self) -> list[str]:
        """`hang 1 of 1: hang after step 40: ...; all_reduce #123 ... waited for rank 1 (...)`, one per hang."""
        return [f"hang {number} of {len(self.hangs)}: {words}" for number, words in enumerate(self.hangs, 1)]

    def slow_rank_lines(self) -> list[str]:
        """`slow rank 1 of 1: rank 1 (pod ...) takes 3.02x the other ranks' time ...`, one per straggler named."""
        return [f"slow rank {n} of {len(self.slow_ranks)}: {words}" for n, words in enumerate(self.slow_ranks, 1)]

    def result_line(self) -> str:
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "nan"
        return (
            f"result: steps={self.steps} final_loss={loss} attempts={self.attempts} "
            f"restarts_in_place={self.restarts_in_place} lost_steps={self.lost_steps} goodput={self.goodput:.3f} wall_seconds={self.wall_seconds:.1f}"
            + (f" hangs={len(self.hangs)}" if self.hangs else "")
            + (f" slow_ranks={len(self.slow_ranks)}" if self.slow_ranks else "")
        )


def _term(name: str) -> str:
    """A breakdown or start-up part as the lines print it: `data_wait` is `data wait`, `startup` is `start-up`."""
    return "start-up" if name == "startup" else name.replace("_", " ")
