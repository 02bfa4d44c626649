"""`Persister`: persisting behind, rank 0 copies checkpoints committed in the memory tier to storage, newest first,
on a thread of its own (see "Persisting behind" in the package's description)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from .context import StoreContext
from .layout import (
    MANIFEST_NAME,
    CheckpointInfo,
    _describe,
    _join,
    logger,
)
from .rotation import Rotation


class Persister:
    """Queues memory checkpoints to be copied to storage (newest wins over one still waiting; the storage interval
    holds back one that comes sooner), copies them on rank 0's persister thread, and waits for it. On the other ranks,
    and when the store does not persist behind, it holds nothing and copies nothing."""

    def __init__(
        self,
        context: StoreContext,
        rotation: Rotation,
        every_steps: Optional[int] = None,
        every_seconds: Optional[float] = None,
    ):
        self._context = context
        self._rotation = rotation
        #: The storage interval: a memory checkpoint that comes sooner after the last one queued is held back (the
        #: next supersedes it, or `flush` queues it). None and None: every memory checkpoint is copied.
        self.every_steps, self.every_seconds = every_steps, every_seconds
        #: The clock of `every_seconds`.
        self.clock: Callable[[], float] = time.monotonic
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-persist")
            if context.persist_behind and context.ranks.rank == 0
            else None
        )
        self._lock = threading.Lock()
        self._next: Optional[tuple[CheckpointInfo, bytes]] = None  # newest wins: the next to copy
        self._copying: Optional[int] = None  # the step being copied
        self._loop: Optional[Future] = None  # the persister's loop, while it runs
        self._last_queued: Optional[tuple[int, float]] = None  # (step, `clock` time) of the last queued copy
        self._held_back: Optional[tuple[CheckpointInfo, bytes]] = None  # newest in memory, before the interval

    @contextmanager
    def steps_held(self) -> Iterator[set[int]]:
        """The steps the persister holds in the memory tier (the one it copies and the one it copies next), fixed
        while the block runs: the tier may drop any other step then."""
        with self._lock:
            steps = {self._copying} if self._copying is not None else set()
            if self._next is not None:
                steps.add(self._next[0].step)
            yield steps

    @property
    def busy(self) -> bool:
        """Rank 0's persister is copying to storage (or about to)."""
        return self._loop is not None

    def queue(self, info: CheckpointInfo, manifest: bytes, whenever: bool = False) -> None:
        """Queue a memory checkpoint to be copied to storage: newest wins over one still waiting. One that comes
        before the storage interval is up is held back instead, unless `whenever` (flush)."""
        assert self._pool is not None, "only rank 0 of a store that persists behind copies to storage"
        tier = self._context.held_tier()
        with self._lock:
            if not whenever and not self._due(info.step):
                self._held_back = (info, manifest)
                return
            self._held_back = None
            self._last_queued = (info.step, self.clock())
            superseded, self._next = self._next, (info, manifest)
            if superseded is not None:
                self._context.metrics.superseded_persists += 1
                logger.info(
                    "checkpoint step %d is not persisted: step %d supersedes it (storage is slower than the "
                    "checkpoint interval)",
                    superseded[0].step,
                    info.step,
                )
                tier.discard(superseded[0].step)
            if self._loop is None:
                self._loop = self._pool.submit(self._copy_queued)

    def queue_held_back(self) -> None:
        """Queue the memory checkpoint the storage interval held back, if any (flush: storage gets the newest)."""
        with self._lock:
            held_back = self._held_back
        if held_back is not None:
            self.queue(*held_back, whenever=True)

    def wait_idle(self) -> None:
        """Wait until every copy queued so far is in storage or failed (a checkpoint held back stays held)."""
        while True:
            with self._lock:
                loop = self._loop
            if loop is None:
                return
            loop.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _due(self, step: int) -> bool:
        if self._last_queued is None or (self.every_steps is None and self.every_seconds is None):
            return True
        queued_step, queued_at = self._last_queued
        return (self.every_steps is not None and step - queued_step >= self.every_steps) or (
            self.every_seconds is not None and self.clock() - queued_at >= self.every_seconds
        )

    def _copy_queued(self) -> None:
        while True:
            with self._lock:
                item, self._next = self._next, None
                if item is None:
                    self._copying, self._loop = None, None
                    return
                self._copying = item[0].step
            self._copy_to_storage(*item)

    def _copy_to_storage(self, info: CheckpointInfo, manifest: bytes) -> None:
        """Copy a memory checkpoint's files to storage, unchanged, then its manifest (the commit); rotate."""
        context, tier, metrics = self._context, self._context.held_tier(), self._context.metrics
        began = time.perf_counter()
        directory = tier.path(info.step)
        try:
            self._rotation.clear_step_dir(info.uri, info.step)
            for name in sorted(info.files or {}):
                context.storage.upload(os.path.join(directory, name), _join(info.uri, name))
            context.storage.write_bytes(_join(info.uri, MANIFEST_NAME), manifest, atomic=True)
        except Exception as exc:  # noqa: BLE001 - never into training: the next memory checkpoint tries again
            metrics.failed_persists += 1
            logger.error(
                "checkpoint step %d (committed in memory) could not be copied to %s: %s",
                info.step,
                info.uri,
                _describe(exc),
                exc_info=True,
            )
            return
        context.trust(info)
        context.in_storage = info
        metrics.last_persist_seconds = time.perf_counter() - began
        metrics.persists += 1
        logger.info("persisted checkpoint step %d to %s (%.2f s)", info.step, info.uri, metrics.last_persist_seconds)
        with self.steps_held() as held:  # the memory tier keeps the newest memory checkpoint and what is queued
            newest = context.in_memory.step if context.in_memory is not None else info.step
            tier.remove_older(newest, keep=held - {info.step})
        tier.prepare_spare({name: size for name, size in (info.files or {}).items() if name.endswith(DEFAULT_SUFFIX)})
        self._rotation.rotate_logging_errors()
