"""Stragglers named under `trainingrun local` (stragglers.py), and what carrying every rank's time costs a step.

1. Named: runs the minimal example (2 training processes on CPU: one node of 2, or 2 simulated nodes of 1) with
   `--chaos-slow-rank FACTOR:RANK` (that rank's part of each step before its first collective takes FACTOR times as
   long) for each factor, until rank 0 names a rank (`slow rank:` in its output), then stops it (Ctrl-C). Prints the
   seconds from the first step to the naming, whether the right rank was named, and the ratio it was named with
   beside the injected factor. Target (issue 80): named within 60 s; the right rank every time.
2. No false straggler: the same run without a fault for `--quiet-seconds`, counting the ranks named (target 0).
3. Cost: the per-step agreement all-reduce between 2 gloo processes on loopback as it was (3 flags, uint8) and as it
   is (3 flags and one float32 time per rank), microseconds per all-reduce side by side (5 alternated rounds, the
   median of each).

    python benchmarks/stragglers.py [--factors 2 3] [--layouts 1x2 2x1] [--quiet-seconds 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "manifests" / "examples" / "minimal-cpu.yaml"
NAMED = re.compile(r": slow rank (\d+) .*? takes ([\d.]+)x")


def one_run(nodes: int, chaos: list[str], stop_after: float) -> dict:
    """A long local run with `chaos` flags, stopped once a rank is named or after `stop_after` seconds of training."""
    with tempfile.TemporaryDirectory(prefix="straggler-bench-") as scratch:
        command = [
            sys.executable, "-m", "trainingrun_operator.cli", "local", str(EXAMPLE),
            "--nproc", str(2 // nodes), "--nodes", str(nodes), "--max-steps", "10000000",
            "--runs-dir", f"{scratch}/runs", "--checkpoint-uri", f"file://{scratch}/checkpoints", *chaos,
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=scratch, start_new_session=True
        )
        assert process.stdout is not None
        row: dict = {"layout": f"{nodes}x{2 // nodes}", "named": []}
        training_since, deadline = None, time.monotonic() + 900
        while time.monotonic() < deadline:
            if training_since is not None and time.monotonic() - training_since > stop_after:
                break
            if not select.select([process.stdout], [], [], 1.0)[0]:
                continue  # no line this second: look at the clock again
            line = process.stdout.readline()
            if not line:
                row["error"] = f"ended with {process.wait()} before a rank was named"
                break
            if training_since is None and re.search(r"attempt 1 step \d+/", line):
                training_since = time.monotonic()
            found = NAMED.search(line)
            if found:
                row["named"].append((time.monotonic() - (training_since or time.monotonic()), *found.groups()))
                break
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)
    return row


def agreement_cost(iterations: int, world: int = 2) -> tuple[float, float]:
    """Microseconds per agreement all-reduce between `world` gloo processes: (before, now)."""
    script = r"""
import os, sys, time, numpy, torch, torch.distributed as dist
dist.init_process_group("gloo")
world, iterations = dist.get_world_size(), int(sys.argv[1])
def cost(values):
    tensor = torch.from_numpy(values)
    for _ in range(50):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    began = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return (time.perf_counter() - began) / iterations * 1e6
rounds = [(cost(numpy.zeros(3, dtype=numpy.uint8)), cost(numpy.zeros(3 + world, dtype=numpy.float32))) for _ in range(5)]
if dist.get_rank() == 0:  # alternated, the median of each: the machine's load moves both alike
    print(f"{sorted(r[0] for r in rounds)[2]} {sorted(r[1] for r in rounds)[2]}")
dist.destroy_process_group()
"""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
        file.write(script)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", file.name,
             str(iterations)],
            capture_output=True, text=True, timeout=600, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        os.unlink(file.name)
    before, now = (float(v) for v in done.stdout.split()[-2:])
    return before, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", nargs="+", type=float, default=[2.0, 3.0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x1"], help="NODESxPROCESSES")
    parser.add_argument("--quiet-seconds", type=float, default=60.0)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chance = random.Random(args.seed)
    named_rows = []
    for layout in args.layouts:
        nodes = int(layout.split("x")[0])
        for factor in args.factors:
            rank = chance.randint(0, 1)
            row = one_run(nodes, ["--chaos-slow-rank", f"{factor:g}:{rank}"], stop_after=300)
            named = row["named"][0] if row["named"] else None
            right = named is not None and int(named[1]) == rank
            named_rows.append((named, right))
            print(
                f"{row['layout']:>4} factor {factor:g} rank {rank}: "
                + (
                    row.get("error", "not named in 300 s")
                    if named is None
                    else f"named after {named[0]:5.1f} s of training: rank {named[1]} at {named[2]}x, right rank {right}"
                ),
                flush=True,
            )
    quiet = one_run(1, [], stop_after=args.quiet_seconds)
    print(f" 1x2 no fault, {args.quiet_seconds:g} s of training: {len(quiet['named'])} rank(s) named", flush=True)
    before, now = agreement_cost(args.iterations)
    print(f"agreement all-reduce, 2 gloo processes: {before:.1f} us before, {now:.1f} us with the times", flush=True)
    times = [named[0] for named, _ in named_rows if named is not None]
    worst = max(times, default=float("nan"))
    right = sum(ok for _, ok in named_rows)
    print(
        f"RESULT runs={len(named_rows)} right_rank={right}/{len(named_rows)} worst_named_s={worst:.1f} (target 60) "
        f"false_named={len(quiet['named'])} (target 0) agreement_us_before={before:.1f} agreement_us_now={now:.1f} "
        f"ratio={now / before:.2f} "
        f"{'ok' if right == len(named_rows) and worst <= 60 and not quiet['named'] else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
