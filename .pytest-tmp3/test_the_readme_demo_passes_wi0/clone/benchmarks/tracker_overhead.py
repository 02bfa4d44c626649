"""Tracker overhead: the built-in trainer with no logger vs an MLflow logger whose server hangs or refuses.

What is measured
    The same training as benchmarks/data_loading.py's synthetic side (CharTransformer dim 128, 2 layers, context
    64, batch 32, one process under torchrun), three ways:

    * no logger;
    * a hung tracker: `loggers: [{kind: mlflow, trackingUri: ...}]` pointing at a server this script runs that
      accepts connections and never answers (the tracker thread waits on its first request all run long);
    * a refusing tracker: the same logger pointing at a closed port (every request fails at once).

    Per side: steps/s from the trainer's own `trainingrun_step_duration_seconds` (as data_loading.py reads it), and
    how many warnings the trainer logged about its trackers (`trainingrun.tracking`): the design says one per
    tracker failure kind (a queue that falls behind, a request that fails), never one per step.

Target
    hung_ratio and refused_ratio (steps/s with the tracker / without) >= 0.98 on an idle machine: a tracker never
    costs a step.

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/tracker_overhead.py            # about a minute on CPU
The last line is `result: hung_ratio=<x> refused_ratio=<x> baseline_steps_per_s=<x> hung_warnings=<n>
refused_warnings=<n>`.
"""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_loading import run_trainer, training_arguments  # noqa: E402


def main() -> None:
    args = training_arguments(__doc__.split("\n\n")[0]).parse_args()
    env = {"CUDA_VISIBLE_DEVICES": "", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    work = Path(tempfile.mkdtemp(prefix="tracker-overhead-"))
    dataset = {
        "classPath": "trainingrun_trainer.data.SyntheticText",
        "initArgs": {"numSamples": 100_000, "contextLength": args.context, "vocabSize": 128},
    }

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # accepts into the backlog, never reads or answers
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connections are refused

    def mlflow(port: int) -> list:
        return [{"kind": "mlflow", "trackingUri": f"http://127.0.0.1:{port}", "experiment": "bench"}]

    try:
        sides = [
            ("no logger", "none", []),
            ("hung tracker", "hung", mlflow(hung.getsockname()[1])),
            ("refusing tracker", "refused", mlflow(refused_port)),
        ]
        figures = {}
        for _label, name, loggers in sides:
            figures[name] = run_trainer(work, name, dataset, args, env, loggers=loggers)
            text = (work / f"{name}.log").read_text()
            figures[name]["warnings"] = sum(1 for line in text.splitlines() if "WARNING trainingrun.tracking" in line)
    finally:
        hung.close()
    base = figures["none"]["steps_per_s"]
    print(f"{args.steps} steps, batch {args.batch_size}, context {args.context}, CPU")
    print(f"{'tracker':<20}{'steps/s':>10}{'vs none':>10}{'warnings':>10}")
    for label, name, _ in sides:
        print(
            f"{label:<20}{figures[name]['steps_per_s']:>10.1f}{figures[name]['steps_per_s'] / base:>10.3f}"
            f"{figures[name]['warnings']:>10}"
        )
    print(
        f"result: hung_ratio={figures['hung']['steps_per_s'] / base:.3f} "
        f"refused_ratio={figures['refused']['steps_per_s'] / base:.3f} baseline_steps_per_s={base:.2f} "
        f"hung_warnings={figures['hung']['warnings']} refused_warnings={figures['refused']['warnings']}"
    )


if __name__ == "__main__":
    main()
