"""Goodput of `trainingrun local` under repeated worker kills.

Trains the demo model (the minimal example's CharTransformer on synthetic text, 2 processes, CPU)
for a fixed number of steps, once without faults and once for each kill period N (a random
worker SIGKILLed N seconds into every attempt, as `--chaos-kill-every N` does). The checkpoint
interval for each setting is chosen with Young's rule, interval = sqrt(2 x save cost x time
between failures), from the measured async save cost and step rate, floored at one second of
steps. Goodput = step time kept in the final model / wall time; lost steps = steps computed but
discarded by restarts; each setting's wall time is printed by part (productive, lost, startup, restore, checkpoint,
data wait, eval, backoff, other). Target: goodput_30s >= 0.95 (issue 19).

    python benchmarks/goodput.py [--steps N] [--periods 10 30 60] [--nproc 2]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "manifests" / "examples" / "minimal-cpu.yaml"


def run_once(body: dict, workdir: Path, name: str, nproc: int, kill_every: float | None):
    from trainingrun_operator import local, validation

    body = yaml.safe_load(yaml.safe_dump(body))
    body["metadata"]["name"] = name
    body["metadata"]["uid"] = str(uuid.uuid4())  # as `trainingrun local` gives a new run one (reports name it)
    body["spec"]["checkpoint"]["uri"] = f"file://{workdir}/{name}/checkpoints"
    options = local.LocalOptions(nproc=nproc, chaos_kill_every=kill_every, runs_dir=str(workdir), chaos_seed=1)
    run = validation.parse(body)
    with open(workdir / f"{name}.out", "w") as out:
        summary = local.LocalRunner(run, options, {}, out=out).execute()
    return summary, (workdir / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="steps per run (default 1500, ~2.5 min on 2 CPU cores)")
    parser.add_argument("--periods", type=float, nargs="+", default=[10, 30, 60], help="kill periods in seconds")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()

    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"]["trainer"]["maxSteps"] = args.steps
    body["spec"]["trainer"]["logIntervalSteps"] = 50
    body["spec"]["recovery"] = {"backoffSeconds": 0, "maxFailures": 1000}

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        body["spec"]["checkpoint"]["interval"] = {"steps": args.steps}  # the baseline saves only at the end
        baseline, baseline_dir = run_once(body, workdir, "baseline", args.nproc, None)
        productive_rate = args.steps / (baseline.goodput * baseline.wall_seconds)  # steps per productive second
        save_cost = 0.02  # seconds a step is blocked by an async save of this model (benchmarks/checkpoint_stall.py)
        print(f"baseline: {args.steps} steps in {baseline.wall_seconds:.1f}s wall, goodput {baseline.goodput:.3f}, "
              f"{productive_rate:.1f} steps/s while training", flush=True)
        rows = []
        for period in args.periods:
            interval_seconds = max(1.0, math.sqrt(2 * save_cost * period))
            interval_steps = max(1, round(interval_seconds * productive_rate))
            body["spec"]["checkpoint"]["interval"] = {"steps": interval_steps}
            summary, _ = run_once(body, workdir, f"kill-{period:g}s", args.nproc, period)
            # Wall time not spent on kept steps: restarts (process start, imports, rendezvous), lost steps.
            unproductive = summary.wall_seconds * (1 - summary.goodput)
            rows.append((period, interval_steps, summary, unproductive / max(1, summary.attempts + summary.restarts_in_place - 1)))
            print(f"kill every {period:g}s: goodput {summary.goodput:.3f}", flush=True)

    print()
    print(f"{'kill every':>10} {'ckpt every':>11} {'starts':>8} {'lost steps':>10} {'lost s/kill':>11} "
          f"{'wall s':>7} {'goodput':>7} {'vs no faults':>12}")
    print(f"{'-':>10} {args.steps:>11} {baseline.attempts + baseline.restarts_in_place:>8} {baseline.lost_steps:>10} {'-':>11} "
          f"{baseline.wall_seconds:>7.1f} {baseline.goodput:>7.3f} {1.0:>12.3f}")
    for period, interval_steps, summary, restart in rows:
        print(f"{period:>9g}s {interval_steps:>11} {summary.attempts + summary.restarts_in_place:>8} {summary.lost_steps:>10} {restart:>11.1f} "
              f"{summary.wall_seconds:>7.1f} {summary.goodput:>7.3f} {summary.goodput / baseline.goodput:>12.3f}")
    print()
    print("where the time went (trainingrun local's breakdown: the processes' own clocks and the supervisor's):")
    print(f"  {'no faults':>14}  {baseline.breakdown_line()}")
    for period, _, summary, _ in rows:
        print(f"  {f'kill every {period:g}s':>14}  {summary.breakdown_line()}")
    print()
    print("goodput counts startup (python, torch import, rendezvous) as unproductive, in the baseline too;")
    print("lost s/kill = wall time not spent on kept steps, per kill (restart + lost steps + backoff 0).")
    print("result: " + " ".join(f"goodput_{p:g}s={s.goodput:.3f}" for p, _, s, _ in rows)
          + f" goodput_no_faults={baseline.goodput:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
