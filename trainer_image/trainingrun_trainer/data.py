"""Generated datasets, and the sampler that lets a resumed run see each sample exactly once.

Why generated data: the trainer must show a run learning (loss falling) on a laptop or in a test,
with no downloads and nothing to mount. Each item is a pure function of `(seed, split, index)`,
made with its own `numpy.random.default_rng([seed, tag, split, index])`, never a global RNG, so
any rank, DataLoader worker or later attempt gets the same item for the same index, whatever was
read before.

Why `ResumableSampler`: `DistributedSampler` deals indices by rank, so its position is per rank
and means nothing once the number of ranks changes, which is exactly what an elastic job does
after a preemption. This sampler's position is global (epoch, samples consumed by all ranks), so
a run stopped at any world size resumes at any other without skipping or repeating a sample.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import multiprocessing
import multiprocessing.context
import os
import queue
import random
import select
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainingrun_api.components import ConfigError

from .background import give_way_to_training

__all__ = [
    "SPLITS",
    "SyntheticText",
    "SyntheticImages",
    "ResumableSampler",
    "in_background",
    "seed_worker",
    "start_worker",
    "worker_processes",
]

SPLITS = ("train", "eval")

# Each use of a seed gets its own nonzero tag in second place and a fixed number of words, so no
# two uses draw the same stream: numpy's SeedSequence ignores trailing zeros ([s, 0] == [s, 0, 0]).
_ITEM_TAG = 1  # [seed, tag, split, index]: one dataset item
_SHARED_TAG = 2  # [seed, tag]: what a dataset shares across splits (the text's "language")
_ORDER_TAG = 3  # [seed, tag, epoch]: the sampler's permutation of an epoch


def _split_id(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    return SPLITS.index(split)


def _check_common(num_samples: int, seed: int) -> None:
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def checked_index(index: int, length: int) -> int:
    """`index` as a position in [0, length), negative ones from the end, as a sequence takes them."""
    index = int(index)
    if index < 0:
        index += length
    if not 0 <= index < length:
        # IndexError (not ValueError) so plain iteration over the dataset stops here.
        raise IndexError(f"index {index} out of range for {length} samples")
    return index


class _SeededItems(Dataset):
    """Map-style dataset of `num_samples` items, item i built from its own seeded numpy Generator."""

    #: Each item is a function of its index alone (no global RNG, nothing read changes state): with numWorkers 0 the
    #: trainer reads it from a background thread (`in_background`) without changing what any step sees.
    pure_items = True

    def __init__(self, num_samples: int, seed: int, split: str):
        _check_common(num_samples, seed)
        self.num_samples = num_samples
        self.seed = seed
        self.split = split
        self._split_id = _split_id(split)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = checked_index(index, self.num_samples)
        return self._make(np.random.default_rng([self.seed, _ITEM_TAG, self._split_id, index]))

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class SyntheticText(_SeededItems):
    """Character sequences from a fixed random Markov chain: `{"tokens": LongTensor[context_length + 1]}`.

    The chain is derived from `seed` alone, so both splits speak the same "language" and eval loss
    measures generalisation, not a different distribution. Each symbol has `BRANCHING` possible
    successors with random weights, so the best achievable loss (about 1 nat, `entropy_rate()`) is
    far below a uniform guess (ln vocab_size), and even a one-layer model gets there in a few
    hundred steps: a visible learning curve. Items start at a random symbol.
    """

    BRANCHING = 4

    def __init__(
        self,
        num_samples: int = 10000,
        context_length: int = 64,
        vocab_size: int = 128,
        seed: int = 0,
        split: str = "train",
    ):
        super().__init__(num_samples, seed, split)
        if not isinstance(context_length, int) or context_length < 1:
            raise ValueError(f"context_length must be a positive integer, got {context_length!r}")
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer of at least 2, got {vocab_size!r}")
        self.context_length = context_length
        self.vocab_size = vocab_size
        rng = np.random.default_rng([seed, _SHARED_TAG])
        branching = min(self.BRANCHING, vocab_size)
        self.successors = np.stack([rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)])
        self.probabilities = rng.dirichlet(np.ones(branching), size=vocab_size)
        # Plain lists: the walk below is a python loop, and bisect on a list beats numpy per call.
        self._cumulative = np.cumsum(self.probabilities, axis=1).tolist()
        self._successor_lists = self.successors.tolist()

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        symbol = int(rng.integers(self.vocab_size))
        tokens = [symbol]
        last_choice = len(self._successor_lists[0]) - 1
        for draw in rng.random(self.context_length).tolist():
            # min() guards a draw above the last cumulative value after rounding.
            choice = min(bisect.bisect_right(self._cumulative[symbol], draw), last_choice)
            symbol = self._successor_lists[symbol][choice]
            tokens.append(symbol)
        return {"tokens": torch.tensor(tokens, dtype=torch.long)}

    def entropy_rate(self) -> float:
        """Mean next-symbol entropy in nats (uniform over states): roughly the best reachable loss."""
        p = self.probabilities
        return float(-(p * np.log(np.clip(p, 1e-12, None))).sum(axis=1).mean())


class SyntheticImages(_SeededItems):
    """Smooth colour images: `{"images": FloatTensor[channels, image_size, image_size]}`, in [-1, 1].

    Each image is a colour, plus a linear ramp in a random direction (with its own colour), plus
    `WAVES` faint plane waves (random orientation, 1-2 cycles per image, random phase). Hidden
    patches can be predicted from visible ones, which is what a masked autoencoder learns: a tiny
    one cuts its loss to about a quarter in a few hundred steps. Random oriented waves alone would
    be honest structure too, but too hard for a tiny model to show a learning curve quickly.
    Amplitudes are bounded (0.4 + 0.4 x 0.71 + 2 x 0.15 < 1), so no value leaves [-1, 1].
    """

    WAVES = 2

    def __init__(
        self,
        num_samples: int = 10000,
        image_size: int = 32,
        channels: int = 3,
        seed: int = 0,
        split: str = "train",
    ):
        super().__init__(num_samples, seed, split)
        if not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be a positive integer, got {channels!r}")
        self.image_size = image_size
        self.channels = channels
        # Centred coordinates, so a ramp through the middle stays within +-0.71 at the corners.
        coordinates = np.arange(image_size) / image_size - 0.5
        self._y, self._x = np.meshgrid(coordinates, coordinates, indexing="ij")

    def _along(self, angle: float) -> np.ndarray:
        return self._x * np.cos(angle) + self._y * np.sin(angle)

    def _colour(self, rng: np.random.Generator, amplitude: float) -> np.ndarray:
        return rng.uniform(-amplitude, amplitude, size=(self.channels, 1, 1))

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        image = self._colour(rng, 0.4) + self._colour(rng, 0.4) * self._along(rng.uniform(0, 2 * np.pi))
        for _ in range(self.WAVES):
            angle, cycles, phase = rng.uniform(0, np.pi), rng.uniform(1, 2), rng.uniform(0, 2 * np.pi)
            image = image + self._colour(rng, 0.15) * np.sin(2 * np.pi * cycles * self._along(angle) + phase)
        return {"images": torch.from_numpy(image.astype(np.float32))}


class ResumableSampler(Sampler[int]):
    """Deals an epoch's global permutation to ranks, with a position that survives a world-size change.

    Each epoch has one permutation of the whole dataset from `(seed, epoch)`, the same on every
    rank. The position is global: `{"epoch": e, "consumed": n}`, where n counts the samples taken
    by all ranks together this epoch. From there, rank r yields `perm[n + r], perm[n + r + W], ...`
    (W ranks), so when every rank takes `samples_per_step` indices per optimizer step, one step
    consumes exactly the next `W * samples_per_step` entries of the permutation, in order. After
    each optimizer step the trainer calls `advance(W * samples_per_step)` on every rank (the same
    value everywhere, so `state_dict()` is the same on every rank and rank 0 can save it). A
    resume at any world size starts at `perm[n:]`: nothing skipped, nothing repeated.

    Why the position moves with `advance()` and not with iteration: DataLoader workers prefetch
    indices ahead of training, so what the iterator has handed out is not what was trained on.

    `samples_per_step` is what one rank takes per optimizer step: batch size x gradient
    accumulation steps. Pass it: with accumulation, an epoch whose per-rank length is not a
    multiple of it ends in the middle of a step, and the DataLoader would hand the next step a
    micro-batch of the old epoch. The ragged tail of an epoch (fewer than `W * samples_per_step`
    samples left) is dropped and the epoch rolls over, because every rank must run the same number
    of steps: a rank with one step fewer would leave the others waiting in an all-reduce forever.
    Which samples form the tail changes every epoch with the permutation, so none is lost for good.

    `len()` and each new iterator reflect the position at the time they are called; a trainer
    making a new iterator after an epoch ends gets the next epoch, with no `set_epoch` needed.
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        samples_per_step: int = 1,
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        if not isinstance(samples_per_step, int) or samples_per_step < 1:
            raise ValueError(f"samples_per_step must be a positive integer, got {samples_per_step!r}")
        if not isinstance(dataset_len, int) or dataset_len < world_size * samples_per_step:
            raise ValueError(
                f"dataset_len ({dataset_len}) is smaller than one global step "
                f"(world_size {world_size} x samples_per_step {samples_per_step}); "
                "use a larger dataset or a smaller batch"
            )
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.samples_per_step = samples_per_step
        self.epoch = 0
        self.consumed = 0

    @property
    def global_step_samples(self) -> int:
        """Samples all ranks together take per optimizer step."""
        return self.world_size * self.samples_per_step

    def permutation(self, epoch: int) -> list[int]:
        """The global order of `epoch`, identical on every rank and every attempt."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        # numpy's SeedSequence hashes all words, so (seed, epoch + 1) and (seed + 1, epoch) differ,
        # unlike DistributedSampler's `seed + epoch`; a torch.Generator would keep only 32 bits.
        return np.random.default_rng([self.seed, _ORDER_TAG, epoch]).permutation(self.dataset_len).tolist()

    def _steps_left(self) -> int:
        return (self.dataset_len - self.consumed) // self.global_step_samples

    def __iter__(self) -> Iterator[int]:
        end = self.consumed + self._steps_left() * self.global_step_samples
        order = self.permutation(self.epoch)
        return iter(order[self.consumed + self.rank : end : self.world_size])

    def __len__(self) -> int:
        return self._steps_left() * self.samples_per_step

    def advance(self, num_global_samples: int) -> None:
        """Record that all ranks together trained on `num_global_samples` more samples (a whole step)."""
        step = self.global_step_samples
        if num_global_samples < 1 or num_global_samples % step:
            raise ValueError(
                f"advance({num_global_samples}): must be a positive multiple of world_size x "
                f"samples_per_step = {step}; pass samples_per_step = batch size x accumulation steps"
            )
        if num_global_samples > self._steps_left() * step:
            raise ValueError(
                f"advance({num_global_samples}): only {self._steps_left() * step} samples are left "
                f"in epoch {self.epoch}"
            )
        self.consumed += num_global_samples
        # Also end the epoch when the rest cannot fill another step of this size: a trainer that
        # left samples_per_step at 1 and drops the last partial batch would otherwise never reach
        # the end and find an epoch with no full batch in it.
        self._roll_over_if_done(next_step=num_global_samples)

    def _roll_over_if_done(self, next_step: int = 0) -> None:
        if self._steps_left() == 0 or self.dataset_len - self.consumed < next_step:
            self.epoch += 1
            self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`; a no-op for the current epoch, so a resumed position is kept.

        For trainers written for DistributedSampler that call `set_epoch(e)` at each epoch start.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a position saved at any world size and batch size.

        If what is left of the epoch is less than one step at the new world size, the epoch ends here.
        """
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or not 0 <= consumed <= self.dataset_len:
            raise ValueError(
                f"sampler state {state!r} does not fit a dataset of {self.dataset_len} samples; "
                "was the dataset changed since the checkpoint?"
            )
        self.epoch, self.consumed = epoch, consumed
        self._roll_over_if_done()


class _ReadAhead(Sampler[int]):
    """A sampler's indices, in its order, with the items `ahead` of the one handed out fetched meanwhile in a
    pool of `threads`: storage latency is paid before the DataLoader (or its workers, which share the node's block
    cache) asks. `missing(index)` says, cheaply, what an item still needs: None when it is cached, else the fetch to
    run in the pool, so a warm cache costs no thread hand-off per item. The sampler's position stays the
    sampler's own (the trainer advances it). A failed fetch is left for the read itself to report, with its clear
    error."""

    def __init__(
        self, sampler: Sampler[int], missing: Callable[[int], Optional[Callable[[], None]]], ahead: int, threads: int
    ):
        self.sampler, self.missing, self.ahead, self.threads = sampler, missing, ahead, threads
        self._begun: tuple[Optional[ThreadPoolExecutor], list[int]] = (None, [])

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def begin(self) -> None:
        """Start fetching the items an iteration would fetch first, from the sampler's position now: the
        model build and the restore then overlap the first batches' fetches, which a cold cache otherwise makes the
        first step wait for. The next iteration goes on with these; if the position moved meanwhile (a resume),
        the fetches not started yet are dropped."""
        self.end_early_fetches()
        pool = self._pool()
        first = list(itertools.islice(iter(self.sampler), self.ahead + 1))
        for index in first:
            self._fetch_in(pool, index)
        self._begun = (pool, first)

    def end_early_fetches(self) -> None:
        pool, _ = self._begun
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._begun = (None, [])

    def __iter__(self) -> Iterator[int]:
        pool, begun = self._begun
        self._begun = (None, [])
        pool = pool or self._pool()
        fetching: collections.deque = collections.deque()
        try:
            for n, index in enumerate(self.sampler):
                if n < len(begun) and begun[n] != index:  # not where begin() was: its fetches are for other items
                    pool.shutdown(wait=False, cancel_futures=True)
                    pool = self._pool()
                    for earlier in fetching:
                        self._fetch_in(pool, earlier)
                    begun = []
                fetching.append(index)
                if n >= len(begun):
                    self._fetch_in(pool, index)
                if len(fetching) > self.ahead:
                    yield fetching.popleft()
            while fetching:
                yield fetching.popleft()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            self.threads, thread_name_prefix="trainingrun-read-ahead", initializer=give_way_to_training
        )

    def _fetch_in(self, pool: ThreadPoolExecutor, index: int) -> None:
        try:
            fetch = self.missing(index)
        except Exception:  # noqa: BLE001 - the read of this item raises it again, where it is reported
            return
        if fetch is not None:
            pool.submit(_quietly, fetch)


def _quietly(fetch: Callable[[], None]) -> None:
    try:
        fetch()
    except Exception:  # noqa: BLE001 - the read of this item raises it again, where it is reported
        pass


T = TypeVar("T")


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


#: How long closing `in_background` waits for its thread to finish the item in hand.
STOP_SECONDS = 60.0


def in_background(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """What `items` yields, in order, made by a thread of its own up to `depth` items ahead: with numWorkers 0 the
    next batches are read while the step computes (its tensor operations release the interpreter lock). Errors
    are raised here, where the item was wanted; closing the iterator stops the thread. The thread gives way to the
    training thread (`background.give_way_to_training`), so taking an item does not cost the taker its CPU.

    Only for datasets whose items do not draw from the global RNGs (`pure_items`): a thread would interleave those
    draws with the training step's and change both."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        give_way_to_training()
        try:
            for item in items:
                ready.put(item)
                if stop.is_set():
                    return
            ready.put(_END)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread
            ready.put(_Failed(exc))

    producer = threading.Thread(target=produce, name="trainingrun-batches", daemon=True)
    producer.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while True:  # make room, so a producer blocked on a full queue sees `stop`
            try:
                ready.get_nowait()
            except queue.Empty:
                break
        # It finishes the item in hand: let it, so it is not inside the dataset when the process exits (a bound, in
        # case a read hangs on storage).
        producer.join(STOP_SECONDS)


def read_ahead(
    sampler: Sampler[int], missing: Callable[[int], Optional[Callable[[], None]]], ahead: int, threads: int
) -> _ReadAhead:
    """`sampler` with the items `ahead` of the one handed out fetched meanwhile in `threads` threads, as
    `missing(index)` says (see _ReadAhead)."""
    return _ReadAhead(sampler, missing, ahead, threads)


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
    start without importing them again."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":  # no effect once this process's forkserver runs; the first loader's list is kept
        context.set_forkserver_preload(["torch", __name__, type(dataset).__module__])
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
