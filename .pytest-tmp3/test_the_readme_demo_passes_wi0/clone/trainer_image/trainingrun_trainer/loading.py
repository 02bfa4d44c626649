"""Getting batches to the training thread: read on it (numWorkers 0), or by DataLoader workers started from a
forkserver (`worker_processes`), each seeded and ending with the trainer; on a GPU copied a batch ahead."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import random
import select
import threading
from multiprocessing import forkserver
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainingrun_api.components import ConfigError

__all__ = [
    "ahead_on_device",
    "batches_of",
    "exit_with",
    "seed_worker",
    "start_worker",
    "worker_processes",
]


def ahead_on_device(batches: Iterable[dict[str, torch.Tensor]], device: torch.device) -> Iterator[dict]:
    """The batches on `device`. On a GPU each batch's copy is queued on a stream of its own a batch ahead (from
    pinned memory it runs while the step before computes), and the step's stream waits for that copy alone, on the
    device: the host never does. Each tensor is marked used by the step's stream, so the allocator does not hand its
    memory to the next copy before the step is done with it."""
    if device.type != "cuda":
        for batch in batches:
            yield {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
        return
    copies, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def start(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        with torch.cuda.stream(copies):
            moved = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
            copied = torch.cuda.Event()
            copied.record(copies)
        return moved, copied

    def use(moved: dict[str, torch.Tensor], copied: torch.cuda.Event) -> dict[str, torch.Tensor]:
        compute.wait_event(copied)
        for tensor in moved.values():
            tensor.record_stream(compute)
        return moved

    ahead = None
    for batch in batches:
        started = start(batch)
        if ahead is not None:
            yield use(*ahead)
        ahead = started
    if ahead is not None:
        yield use(*ahead)


def seed_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: seed python `random`, numpy and torch in each worker.

    DataLoader gives each worker the torch seed `base_seed + worker_id`, where `base_seed` comes
    from the loader's generator, but leaves python `random` and numpy as forked copies of the
    parent's state, identical in every worker. Deriving all three from `torch.initial_seed()`
    makes augmentations differ across workers and repeat across runs with the same seed.
    """
    seed = torch.initial_seed() % 2**32  # numpy takes 32-bit seeds
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_worker(trainer_pid: int) -> Callable[[int], None]:
    """The DataLoader's `worker_init_fn`: `seed_worker`, and end the worker when the trainer process `trainer_pid`
    ends (`exit_with`)."""
    return functools.partial(_start_worker, trainer_pid)


def _start_worker(trainer_pid: int, worker_id: int) -> None:
    exit_with(trainer_pid)
    seed_worker(worker_id)


def exit_with(pid: int) -> None:
    """End this process as soon as process `pid` ends. torch's worker ends when its parent does, but a worker
    started by a forkserver is the forkserver's child, and the forkserver lives while any of its children holds its
    pipe: once the trainer was SIGKILLed, worker and forkserver kept each other alive for good, with the trainer's
    stderr open, and every restart of a trainer in the same pod left another pair."""
    try:
        trainer = os.pidfd_open(pid)
    except ProcessLookupError:  # it ended before this worker got here
        os._exit(0)

    def wait_for_the_trainer() -> None:
        select.select([trainer], [], [])  # readable once it has ended
        os._exit(0)

    threading.Thread(target=wait_for_the_trainer, name="trainingrun-exit-with-trainer", daemon=True).start()


def worker_processes(method: str, dataset: Dataset) -> multiprocessing.context.BaseContext:
    """Where a DataLoader's workers start from (`spec.trainer.data.workerStartMethod`). A forkserver is a process
    that never ran the trainer's threads: forking the training process itself while its checkpoint or read-ahead
    thread held a lock of torch's thread pool left the worker stuck in `torch.set_num_threads` and the run waiting
    for its batch forever. The forkserver imports torch and the dataset's module once, so each epoch's workers
    start without importing them again. It is started here, at once: called while the run builds its model and
    restores, its imports overlap that work instead of delaying the first batch (1.5 s on the 2-core VM)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":  # no effect once this process's forkserver runs; the first loader's list is kept
        context.set_forkserver_preload(["torch", __name__, type(dataset).__module__])
        forkserver.ensure_running()
    return context


def batches_of(loader: DataLoader, method: str) -> Iterator[dict[str, torch.Tensor]]:
    """`iter(loader)`, starting its workers; a dataset that cannot be sent to them is a configuration error."""
    try:
        return iter(loader)
    except Exception as error:
        if loader.num_workers == 0 or method == "fork" or "pickl" not in str(error).lower():
            raise
        raise ConfigError(
            f"spec.trainer.data.dataset: {type(loader.dataset).__qualname__} cannot be sent to worker processes "
            f"started by {method} ({type(error).__name__}: {error}); make it picklable (e.g. open files and clients "
            "lazily, in __getitem__) or set spec.trainer.data.workerStartMethod: fork"
        ) from error
