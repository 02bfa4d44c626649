"""Early throughput (issue 78 item 7): are the steps before a run's first checkpoint commit slower than the steps
after it, and if so, is it the commit or just the run warming up?

What is measured
    `trainingrun local` runs the built-in model (manifests/examples/minimal-cpu.yaml) for `--steps` steps on
    `--nproc` processes, logging every `--log-every` steps, once with its first commit early (checkpoint interval
    `--early`) and once with it late (`--late`), `--runs` times, the two alternating. From rank 0's log lines, the
    samples/s of each window (the trainer's own figure: training time only, saves and evaluations left out) are
    averaged over two step ranges: `before` = steps `--log-every`+1 .. `--early` (the first window, which holds the
    first step's warm-up, is left out) and `after` = `--early`+1 .. `--late`. With the early schedule a commit falls
    between the ranges; with the late one none does. If the after/before ratio is about the same for both schedules,
    what changes is the run warming up, not the commit; if only the early schedule's ratio rises, the commit is it.
    The first window's reading (with the first step in it, before the fix) over the median reading is shown too.
    `--busy N` adds N processes that spin on the CPU while each run trains (the issue's figures came from a busy
    machine); they stop when the run ends.

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/early_throughput.py            # ~3 min on the 2-core VM
    .venv/bin/python benchmarks/early_throughput.py --busy 2   # the same with the CPUs shared
    .venv/bin/python benchmarks/early_throughput.py --compile  # torch.compile: a first step of seconds
The last line is `result: trainer_early_commit_ratio=<after/before> trainer_late_commit_ratio=<x>
wall_early_commit_ratio=<x> wall_late_commit_ratio=<x> first_reading_ratio=<x> busy=<n> cpus=<n>`: medians over
the runs. The trainer's
figure and the wall clock's are both given, so an effect in how the trainer counts (the time a background save took
from the steps beside it is moved out of their time) is told apart from one in how fast the steps really ran.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "manifests" / "examples" / "minimal-cpu.yaml"
_STEP_LINE = re.compile(
    r"^(\S+ \S+) rank0 INFO trainingrun\.trainer: step (\d+)/\d+ .* samples/s ([0-9.]+)", re.MULTILINE
)
_COMMIT_LINE = re.compile(r"rank0 INFO trainingrun\.checkpoint: committed checkpoint step (\d+)")


def _spin(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


def one_run(
    folder: Path, interval: int, args: argparse.Namespace
) -> tuple[dict[int, float], dict[int, float], list[int]]:
    """From rank 0's lines of one run: {step: the trainer's samples/s of the window ending there}, {step: steps per
    wall second in that window, by the lines' times, for windows with no commit in them} and the committed steps."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["metadata"]["name"] = f"early-{interval}"
    spec["spec"]["trainer"]["logIntervalSteps"] = args.log_every
    spec["spec"]["checkpoint"]["interval"]["steps"] = interval
    if args.compile:
        spec["spec"]["trainer"]["compile"] = True
    path = folder / f"early-{interval}.yaml"
    path.write_text(yaml.safe_dump(spec))
    spinners = [
        multiprocessing.Process(target=_spin, args=(time.monotonic() + 600,), daemon=True) for _ in range(args.busy)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        subprocess.run(
            [str(Path(sys.executable).parent / "trainingrun"), "local", str(path), "--nproc", str(args.nproc)]
            + ["--max-steps", str(args.steps)],
            cwd=folder,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    log = (folder / "runs" / spec["metadata"]["name"] / "attempt-1.log").read_text()
    lines = [(int(m[2]), float(m[3]), _seconds(m[1])) for m in _STEP_LINE.finditer(log)]
    commits = [int(m[1]) for m in _COMMIT_LINE.finditer(log)]
    trainer = {step: rate for step, rate, _ in lines}
    wall = {
        step: (step - before) / max(at - then, 1e-6)
        for (before, _, then), (step, _, at) in zip(lines, lines[1:])
        if not any(before <= commit < step for commit in commits)
    }
    return trainer, wall, commits


def _seconds(stamp: str) -> float:
    """A log line's `YYYY-mm-dd HH:MM:SS,mmm` as seconds (within one run: the date is the same or the next)."""
    moment = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    return moment.timestamp()


def mean_between(windows: dict[int, float], first: int, last: int) -> float:
    return statistics.fmean(rate for step, rate in windows.items() if first <= step <= last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--early", type=int, default=40, help="checkpoint interval with an early first commit")
    parser.add_argument("--late", type=int, default=100, help="checkpoint interval with a late one")
    parser.add_argument("--runs", type=int, default=2, help="runs of each schedule, alternating")
    parser.add_argument("--compile", action="store_true", help="spec.trainer.compile: true (a slow first step)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during each run")
    args = parser.parse_args()
    before = (2 * args.log_every, args.early)  # window ends: the first window (warm-up) left out
    after = (args.early + args.log_every, args.late)
    ratios: dict[tuple[str, int], list[float]] = {
        (kind, interval): [] for kind in ("trainer", "wall") for interval in (args.early, args.late)
    }
    print(
        f"mean of {args.log_every}-step windows, 'before' = steps to {args.early}, 'after' = to {args.late}: the "
        "trainer's samples/s (saves and evaluations left out), and steps per wall second by the log lines' times "
        "(windows with a commit left out)"
    )
    print(
        f"{'run':>3} {'interval':>8} {'1st commit':>10} {'trainer before':>14} {'after':>7} {'ratio':>6} "
        f"{'wall steps/s before':>19} {'after':>6} {'ratio':>6} {'first/median':>13}"
    )
    firsts: list[float] = []
    with tempfile.TemporaryDirectory(prefix="early-throughput-") as folder:
        for run in range(args.runs):
            for interval in (args.early, args.late):
                own = Path(folder) / f"run-{run}-{interval}"  # a run folder of its own: never a resume
                own.mkdir()
                trainer, wall, commits = one_run(own, interval, args)
                figures = []
                for kind, windows in (("trainer", trainer), ("wall", wall)):
                    early, late = mean_between(windows, *before), mean_between(windows, *after)
                    ratios[kind, interval].append(late / early)
                    figures.append((early, late, late / early))
                (t_early, t_late, t_ratio), (w_early, w_late, w_ratio) = figures
                first = trainer[min(trainer)] / statistics.median(trainer.values())
                firsts.append(first)
                print(
                    f"{run:>3} {interval:>8} {commits[0] if commits else '-':>10} {t_early:>14.1f} {t_late:>7.1f} "
                    f"{t_ratio:>6.2f} {w_early:>19.2f} {w_late:>6.2f} {w_ratio:>6.2f} {first:>13.2f}"
                )
    median = {key: statistics.median(values) for key, values in ratios.items()}
    print(
        f"result: trainer_early_commit_ratio={median['trainer', args.early]:.2f} "
        f"trainer_late_commit_ratio={median['trainer', args.late]:.2f} "
        f"wall_early_commit_ratio={median['wall', args.early]:.2f} wall_late_commit_ratio={median['wall', args.late]:.2f} "
        f"first_reading_ratio={statistics.median(firsts):.2f} busy={args.busy} cpus={os.cpu_count()}"
    )


if __name__ == "__main__":
    main()
