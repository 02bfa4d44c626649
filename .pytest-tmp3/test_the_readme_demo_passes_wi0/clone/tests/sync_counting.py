"""Counting the calls that make the host wait for a GPU, on a CPU: the tests' and benchmarks' check that a training
step queues work and never waits for it (issue 64).

On a CPU nothing waits, so nothing can be timed: the calls are counted instead. `Tensor.item`, `__float__`, `__int__`,
`__bool__`, `tolist` and `cpu` read a tensor's value on the host (on a GPU: after everything queued before it ran);
`torch.cuda.synchronize` and `Event`/`Stream.synchronize` wait outright. Reading host memory (`numpy()`, which a CUDA
tensor refuses) is not counted: it cannot wait for a device.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

TENSOR_CALLS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")
CUDA_WAITS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"))


class SyncCounter:
    """Counts those calls by the step `at()` says the loop is at, while installed (a context manager)."""

    def __init__(self, at: Callable[[], int]):
        self.at = at
        self.by_step: collections.Counter[int] = collections.Counter()
        self.by_call: collections.Counter[str] = collections.Counter()
        self._originals: list[tuple[Any, str, Any]] = [
            (torch.Tensor, name, getattr(torch.Tensor, name)) for name in TENSOR_CALLS
        ]
        self._originals += [(owner, name, getattr(owner, name)) for owner, name in CUDA_WAITS]

    def __enter__(self) -> "SyncCounter":
        for owner, name, original in self._originals:
            setattr(owner, name, self._counting(f"{getattr(owner, '__name__', owner)}.{name}", original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)

    def _counting(self, name: str, original: Callable) -> Callable:
        def counted(*args: object, **kwargs: object) -> object:
            self.by_step[self.at()] += 1
            self.by_call[name] += 1
            return original(*args, **kwargs)

        return counted

    def per_step(self, first: int, last: int, log_interval: int) -> float:
        """Calls a step made, over steps `first` to `last` but those at and just before a log line (a call made at
        step s is made while step s + 1 runs)."""
        steps = [s for s in range(first, last) if s % log_interval not in (0, log_interval - 1)]
        return sum(self.by_step[s] for s in steps) / max(len(steps), 1)


def count_trainer_steps(config_path: str, device_type: str = "cpu") -> dict[int, int]:
    """Runs the trainer of the config at `config_path` in this process, counting; calls by step. On a GPU, CUDA's own
    account is counted too: every synchronisation it warns of (`torch.cuda.set_sync_debug_mode("warn")`)."""
    import os
    import warnings

    from trainingrun_trainer.context import RunContext
    from trainingrun_trainer.trainer import Trainer

    os.environ.update({"TRAININGRUN_CONFIG": config_path, "TRAININGRUN_NAME": "syncs"})
    context = RunContext.from_env()
    trainer = Trainer(context.load_config(), context, device_type)
    with SyncCounter(lambda: trainer.progress.step) as counter, warnings.catch_warnings():
        if device_type == "cuda":
            shown = warnings.showwarning

            def count_synchronising(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if "synchroniz" in str(message):
                    counter.by_step[trainer.progress.step] += 1
                    counter.by_call["cuda sync debug"] += 1
                shown(message, category, *args, **kwargs)

            warnings.simplefilter("always")
            warnings.showwarning = count_synchronising
            torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.run()
        finally:
            if device_type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    return dict(counter.by_step)


if __name__ == "__main__":  # python tests/sync_counting.py CONFIG [cpu|cuda]: {step: calls} as JSON on stdout
    import json
    import sys

    torch.set_num_threads(1)
    print(json.dumps(count_trainer_steps(sys.argv[1], *sys.argv[2:3])))
