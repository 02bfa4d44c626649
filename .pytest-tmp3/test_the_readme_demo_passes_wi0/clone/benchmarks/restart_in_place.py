"""How long a worker killed mid-run takes to train again when torchrun restarts it in place, compile off and on.

Runs the minimal example (`trainingrun local`, the demo model on CPU, one process by default) with one
`--chaos-kill-step`, once without and once with `compile: true`, each after a run that filled the compile cache (the
pod keeps it in /tmp, so an in-place restart finds it). From the worker's log: the kill's timestamp and the restarted
worker's first trained step (its `start-up ... to the first step` line) give `restart_to_training_s`; the worker's
own phases say where that time went. Target (issue 38): <= 3 s on CPU with compile on.

    python benchmarks/restart_in_place.py [--nproc 1] [--kill-step 60] [--steps 100] [--modes eager compile]

On a GPU machine the trainer runs the model on CUDA (`benchmarks/gpu_suite.py` runs `--modes compile`).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import yaml
from goodput import EXAMPLE, run_once  # benchmarks/ is the script's directory: on sys.path

STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def restart_figures(log: str) -> tuple[float, str]:
    """Seconds from the kill to the restarted worker's first trained step, and that worker's start-up phases."""

    def when(line: str) -> datetime:
        return datetime.strptime(re.match(STAMP, line).group(1), "%Y-%m-%d %H:%M:%S,%f")

    lines = log.splitlines()
    kill = next(i for i, line in enumerate(lines) if "chaos: SIGKILL" in line and re.match(STAMP, line))
    started = next(line for line in lines[kill:] if "rank0" in line and "to the first step" in line)
    phases = started.split("to the first step: ", 1)[1]
    return (when(started) - when(lines[kill])).total_seconds(), phases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=60, help="a step past a checkpoint (every 50), so it restores")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compile"], default=["eager", "compile"])
    args = parser.parse_args()

    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"]["trainer"]["maxSteps"] = args.steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for label in args.modes:
            body["spec"]["trainer"]["compile"] = label == "compile"
            run_once(body, workdir, f"{label}-warm-up", args.nproc)  # fills the compile cache, as a first start
            _, run_dir = run_once(body, workdir, label, args.nproc, chaos_kill_steps=[args.kill_step])
            seconds, phases = restart_figures((run_dir / "attempt-1.log").read_text())
            rows.append((label, seconds, phases))
            print(f"{label}: trained again {seconds:.2f} s after the kill ({phases})", flush=True)
    print()
    print(f"{'model':>8} {'kill -> training s':>18}  restarted worker's start-up")
    for label, seconds, phases in rows:
        print(f"{label:>8} {seconds:>18.2f}  {phases}")
    seconds = {label: value for label, value, _ in rows}
    figures = [f"restart_to_training_s={seconds['compile']:.2f}"] if "compile" in seconds else []
    if "eager" in seconds:
        figures.append(f"restart_to_training_eager_s={seconds['eager']:.2f}")
    if len(seconds) == 2:
        figures.append(f"compile_vs_eager={seconds['compile'] / seconds['eager']:.2f}")
    print("result: " + " ".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
