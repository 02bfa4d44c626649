"""The sampler that lets a resumed run see each sample exactly once, and the read-ahead that fetches what it deals
before the DataLoader asks.

Why `ResumableSampler`: `DistributedSampler` deals indices by rank, so its position is per rank
and means nothing once the number of ranks changes, which is exactly what an elastic job does
after a preemption. This sampler's position is global (epoch, samples consumed by all ranks), so
a run stopped at any world size resumes at any other without skipping or repeating a sample.
"""

from __future__ import annotations

import collections
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import numpy as np
from torch.utils.data import Sampler

from .background import give_way_to_training
from .data import ORDER_TAG

__all__ = ["ResumableSampler", "read_ahead"]


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
        return np.random.default_rng([self.seed, ORDER_TAG, epoch]).permutation(self.dataset_len).tolist()

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


def read_ahead(
    sampler: Sampler[int], missing: Callable[[int], Optional[Callable[[], None]]], ahead: int, threads: int
) -> _ReadAhead:
    """`sampler` with the items `ahead` of the one handed out fetched meanwhile in `threads` threads, as
    `missing(index)` says (see _ReadAhead)."""
    return _ReadAhead(sampler, missing, ahead, threads)
