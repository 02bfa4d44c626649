"""Hangs found, named and recovered from under `trainingrun local` (hangs.py), each kind side by side.

Runs the minimal example (2 training processes on CPU: one node of 2, or 2 simulated nodes of 1) with
`--chaos-hang KIND:STEP:RANK` for each kind (stop: SIGSTOP; block: blocks before its next collective; data: its data
loader blocks), a random step and rank (seeded), with spec.recovery.hangTimeoutSeconds as the file has it (`auto`:
at least 30 s). From the run's logs (their timestamps) it prints, per run: seconds from the hang to the diagnosis
(`hang diagnosis:`), from the hang to training again (the restarted group's first step), whether the diagnosis named
the hung rank and a collective, and the steps the run completed. Targets (issue 80): diagnosis within 60 s with the
defaults when a step takes under a second; the right rank named every time; training again within 90 s.

    python benchmarks/hangs.py [--kinds stop block data] [--layouts 1x2 2x1] [--steps 150] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "manifests" / "examples" / "minimal-cpu.yaml"
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamped(lines: list[str], pattern: str) -> list[tuple[datetime, str]]:
    found = []
    for line in lines:
        match = STAMP.match(line)
        if match and re.search(pattern, line):
            found.append((datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f"), line))
    return sorted(found)


def one_run(kind: str, nodes: int, step: int, rank: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hang-bench-") as scratch:
        command = [
            sys.executable, "-m", "trainingrun_operator.cli", "local", str(EXAMPLE),
            "--nproc", str(2 // nodes), "--nodes", str(nodes), "--max-steps", str(steps),
            "--chaos-hang", f"{kind}:{step}:{rank}", "--runs-dir", f"{scratch}/runs",
            "--checkpoint-uri", f"file://{scratch}/checkpoints",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=scratch)
        lines = [
            line for log in sorted(Path(scratch).glob("runs/*/attempt-*.log")) for line in log.read_text().splitlines()
        ]
    hung = stamped(lines, r"chaos: rank \d+ hangs after step")
    diagnosed = stamped(lines, r"hang diagnosis: hang after")
    first_steps = stamped(lines, r"to the first step")
    row = {"kind": kind, "layout": f"{nodes}x{2 // nodes}", "step": step, "rank": rank, "code": done.returncode}
    if not hung or not diagnosed:
        row["error"] = "no hang seen" if not hung else "no diagnosis"
        return row
    at = hung[0][0]
    again = next((moment for moment, _ in first_steps if moment > diagnosed[0][0]), None)
    summary = diagnosed[0][1].split("hang diagnosis: ", 1)[1]
    row.update(
        diagnosed_s=(diagnosed[0][0] - at).total_seconds(),
        training_again_s=(again - at).total_seconds() if again else None,
        right_rank=bool(re.search(rf"waited for rank {rank}\b", summary)),
        collective=bool(re.search(r"#\d+ of process group", summary)),
        finished=f"steps={steps}" in done.stdout,
        summary=summary,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["stop", "block", "data"])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x1"], help="NODESxPROCESSES")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chance = random.Random(args.seed)
    rows = []
    for layout in args.layouts:
        nodes = int(layout.split("x")[0])
        for kind in args.kinds:
            row = one_run(kind, nodes, chance.randint(15, 45), chance.randint(0, 1), args.steps)
            rows.append(row)
            print(
                f"{row['layout']:>4} {kind:>5} step {row['step']:>3} rank {row['rank']}: "
                + (
                    row["error"]
                    if "error" in row
                    else f"diagnosed {row['diagnosed_s']:5.1f} s, training again "
                    f"{row['training_again_s'] if row['training_again_s'] is None else round(row['training_again_s'], 1)} s, "
                    f"right rank {row['right_rank']}, collective {row['collective']}, finished {row['finished']}"
                ),
                flush=True,
            )
            if "summary" in row:
                print(f"      {row['summary']}", flush=True)
    good = [row for row in rows if "error" not in row]
    worst_diagnosis = max((row["diagnosed_s"] for row in good), default=float("nan"))
    agains = [row["training_again_s"] for row in good if row["training_again_s"] is not None]
    worst_again = max(agains, default=float("nan"))
    right = sum(row["right_rank"] for row in good)
    print(
        f"RESULT runs={len(rows)} diagnosed={len(good)} right_rank={right}/{len(rows)} "
        f"worst_diagnosis_s={worst_diagnosis:.1f} (target 60) worst_training_again_s={worst_again:.1f} (target 90) "
        f"{'ok' if right == len(rows) and len(agains) == len(rows) and worst_diagnosis <= 60 and worst_again <= 90 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
