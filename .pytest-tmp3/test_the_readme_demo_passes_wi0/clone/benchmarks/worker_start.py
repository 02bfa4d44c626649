"""DataLoader workers' start: how long the first batch takes with workers forked from the training process, and
from a forkserver started at the first batch or earlier, while the run builds its model and restores.

What is measured
    In a fresh interpreter that has imported torch and the trainer, the wall time from creating a DataLoader of
    `trainingrun_trainer.data.SyntheticText` (2 workers, batch 8, context 64) to its first batch, three ways:

    * fork: workers forked from this process (the trainer's way before `workerStartMethod`; it could hang, see
      loading.worker_processes);
    * forkserver, late: the forkserver started by the first batch (it imports torch and the dataset's module then);
    * forkserver, early: started by `loading.worker_processes` (as the trainer does while it builds its model and
      restores), `--overlap` seconds before the first batch: the time that work would take.

    Each way runs `--repeats` times, each in its own interpreter; medians are printed.

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/worker_start.py               # about 20 s on the 2-core VM
The last line is `result: fork_first_batch_s=<x> forkserver_late_first_batch_s=<x>
forkserver_early_first_batch_s=<x> early_vs_late=<x>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

ONE_RUN = """
import os, sys, time
from multiprocessing import forkserver
from torch.utils.data import DataLoader
from trainingrun_trainer.data import SyntheticText
from trainingrun_trainer.loading import batches_of, start_worker, worker_processes

def run(way, overlap):
    dataset = SyntheticText(num_samples=256, context_length=64)
    method = "fork" if way == "fork" else "forkserver"
    if way == "early":
        context = worker_processes(method, dataset)  # starts the forkserver
        time.sleep(overlap)  # stands for the model build and restore it overlaps
    started = time.perf_counter()
    if way == "late":
        import multiprocessing
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "trainingrun_trainer.data"])
    elif way == "fork":
        context = worker_processes(method, dataset)
    loader = DataLoader(
        dataset, batch_size=8, num_workers=2, multiprocessing_context=context, worker_init_fn=start_worker(os.getpid())
    )
    next(batches_of(loader, method))
    print(time.perf_counter() - started)

if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]))
"""


def first_batch(way: str, overlap: float) -> float:
    done = subprocess.run(
        [sys.executable, "-c", ONE_RUN, way, str(overlap)], capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overlap", type=float, default=3.0, help="seconds of model build and restore (early start)")
    args = parser.parse_args()
    medians = {}
    for way in ("fork", "late", "early"):
        seconds = [first_batch(way, args.overlap) for _ in range(args.repeats)]
        medians[way] = statistics.median(seconds)
        print(f"{way:>6}: first batch {medians[way]:.3f} s (runs: {', '.join(f'{s:.3f}' for s in seconds)})")
    print(
        f"result: fork_first_batch_s={medians['fork']:.3f} forkserver_late_first_batch_s={medians['late']:.3f} "
        f"forkserver_early_first_batch_s={medians['early']:.3f} early_vs_late={medians['early'] / medians['late']:.3f}"
    )


if __name__ == "__main__":
    main()
