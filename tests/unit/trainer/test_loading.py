"""loading: DataLoader workers seeded apart and reproducibly, started from a forkserver (a lock a trainer thread holds
is not held in them), ended with the trainer; batches made on a thread arrive in order and carry the dataset's error."""

import os
import random
import select
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainingrun_api.model_base import ConfigError
from trainingrun_trainer.loading import ahead_on_device, batches_of, seed_worker, worker_processes

# ---------------------------------------------------------------- worker seeding


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seed_worker_seeds_every_rng_from_torch_initial_seed():
    torch.manual_seed(1234)
    seed_worker(0)
    first = _draws()
    torch.manual_seed(1234)
    seed_worker(0)
    assert _draws() == first
    torch.manual_seed(99)
    seed_worker(0)
    assert _draws() != first


class NumpyNoise(torch.utils.data.Dataset):
    """An 'augmentation' from numpy's global RNG, as user datasets often do."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(np.random.rand())


def test_dataloader_workers_differ_from_each_other_and_repeat_across_runs():
    def run():
        loader = DataLoader(
            NumpyNoise(), batch_size=1, num_workers=2, worker_init_fn=seed_worker,
            generator=torch.Generator().manual_seed(0), multiprocessing_context="fork",
        )  # fmt: skip
        return [float(x) for x in loader]

    values = run()
    assert values == run()
    # Items 0 and 1 come from different workers; forked numpy state alone would make them equal.
    assert values[0] != values[1]


#: Stands for a lock of torch's thread pool that a trainer thread (checkpoint, read-ahead) may hold when workers start.
HELD_BY_A_TRAINER_THREAD = threading.Lock()


class NeedsTheLock(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        with HELD_BY_A_TRAINER_THREAD:
            return torch.tensor(index)


@pytest.mark.slow
def test_workers_start_from_a_forkserver_so_a_lock_held_by_a_trainer_thread_is_not_held_in_them():
    held, release = threading.Event(), threading.Event()

    def hold():
        with HELD_BY_A_TRAINER_THREAD:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        dataset = NeedsTheLock()
        loader = DataLoader(
            dataset, batch_size=2, num_workers=2, multiprocessing_context=worker_processes("forkserver", dataset),
            timeout=60,  # a deadline: a worker stuck on the lock fails the test instead of hanging it
        )  # fmt: skip
        assert [batch.tolist() for batch in batches_of(loader, "forkserver")] == [[0, 1], [2, 3]]
        # What the trainer did before: a forked worker inherits the lock as held, and nobody there releases it.
        forked = DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork", timeout=2)
        with pytest.raises(RuntimeError, match="timed out"):
            list(forked)
    finally:
        release.set()
        holder.join()


KILLED_WITH_WORKERS = """
import os, signal
from multiprocessing import forkserver
from torch.utils.data import DataLoader
from trainingrun_trainer.data import SyntheticText
from trainingrun_trainer.loading import batches_of, start_worker, worker_processes

dataset = SyntheticText(num_samples=64, context_length=8)
loader = DataLoader(
    dataset, batch_size=2, num_workers=2, multiprocessing_context=worker_processes("forkserver", dataset),
    worker_init_fn=start_worker(os.getpid()),
)
batches = batches_of(loader, "forkserver")
next(batches)
print(forkserver._forkserver._forkserver_pid, *(worker.pid for worker in batches._workers), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_workers_and_their_forkserver_end_when_the_trainer_is_killed():
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WITH_WORKERS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # The forkserver and the workers hold the trainer's stdout and stderr: they are closed once all of them ended.
    # Before, the workers outlived a killed trainer, kept their forkserver alive and this waited forever.
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == -9, err
    forkserver_and_workers = [int(pid) for pid in out.split()]
    assert len(forkserver_and_workers) == 3
    assert [pid for pid in forkserver_and_workers if not ends_within(pid, 30)] == []


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` has ended (a zombie included: an orphan's status is its new parent's to collect) or ends
    within `seconds`. Closing its files is not the end yet: an exiting process closes them first."""
    try:
        process = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([process], [], [], seconds)[0])  # readable once it has ended
    finally:
        os.close(process)


class HoldsALock(torch.utils.data.Dataset):
    def __init__(self):
        self.lock = threading.Lock()

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return torch.tensor(index)


def test_a_dataset_workers_cannot_be_sent_is_a_config_error_naming_the_way_out():
    dataset = HoldsALock()
    loader = DataLoader(dataset, num_workers=1, multiprocessing_context=worker_processes("forkserver", dataset))
    with pytest.raises(ConfigError) as raised:
        batches_of(loader, "forkserver")
    message = str(raised.value)
    assert message.startswith("spec.trainer.data.dataset: HoldsALock cannot be sent to worker processes")
    assert "workerStartMethod: fork" in message and "lock" in message
    forked = DataLoader(dataset, num_workers=1, multiprocessing_context=worker_processes("fork", dataset))
    assert [int(batch) for batch in batches_of(forked, "fork")] == [0, 1]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu_suite.py runs it)"),
        ),
    ],
)
def test_batches_reach_the_device_in_order_and_intact_each_one_ahead(device):
    torch.manual_seed(0)
    source = [{"x": torch.randn(64, 256).pin_memory() if device == "cuda" else torch.randn(64, 256)} for _ in range(5)]
    taken: list[int] = []

    def read():
        for index, batch in enumerate(source):
            taken.append(index)
            yield batch

    moved = ahead_on_device(read(), torch.device(device))
    first = next(moved)
    # On a GPU the next batch's copy is already queued when the first is handed over; on a CPU nothing is read ahead.
    assert taken == ([0, 1] if device == "cuda" else [0])
    received = [first, *moved]
    assert [b["x"].device.type for b in received] == [device] * 5
    # The step's stream reads each copy after it finished (the wait is on the device): all bytes arrive.
    assert all(torch.equal(b["x"].cpu(), s["x"]) for b, s in zip(received, source))
