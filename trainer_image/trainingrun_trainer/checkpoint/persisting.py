"""Persisting behind: rank 0 copies checkpoints committed in the memory tier to storage, newest first (a part of
`CheckpointStore`; see "Persisting behind" in the package's description)."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from .layout import (
    MANIFEST_NAME,
    CheckpointInfo,
    _describe,
    _join,
    logger,
)


class PersistingBehind:
    """CheckpointStore's copies to storage behind the memory tier: queueing (newest wins, the storage interval), the
    persister's loop, and waiting for it (`flush`, `wait_persisted`). State lives in `CheckpointStore.__init__`."""

    _persist_next: Optional[tuple[CheckpointInfo, bytes]]
    _held_back: Optional[tuple[CheckpointInfo, bytes]]
    _last_queued: Optional[tuple[int, float]]
    in_memory: Optional[CheckpointInfo]
    in_storage: Optional[CheckpointInfo]
    _persisting: Optional[int]
    _persist_loop: Optional[Future]

    def _persist_steps(self) -> set[int]:
        """The steps the persister holds in the memory tier: the one it copies and the one it copies next."""
        steps = {self._persisting} if self._persisting is not None else set()
        if self._persist_next is not None:
            steps.add(self._persist_next[0].step)
        return steps

    def _persist(self, info: CheckpointInfo, manifest: bytes, whenever: bool = False) -> None:
        """Queue a memory checkpoint to be copied to storage: newest wins over one still waiting. One that comes
        before the storage interval is up (`persist_every_steps`/`_seconds`) is held back instead, unless `whenever`
        (flush): the next memory checkpoint supersedes it, or flush() queues it."""
        with self._persist_lock:
            if not whenever and not self._persist_due(info.step):
                self._held_back = (info, manifest)
                return
            self._held_back = None
            self._last_queued = (info.step, self._clock())
            superseded, self._persist_next = self._persist_next, (info, manifest)
            if superseded is not None:
                self.superseded_persists += 1
                logger.info(
                    "checkpoint step %d is not persisted: step %d supersedes it (storage is slower than the "
                    "checkpoint interval)",
                    superseded[0].step,
                    info.step,
                )
                self._tier.discard(superseded[0].step)
            if self._persist_loop is None:
                self._persist_loop = self._persister.submit(self._persist_queued)

    def _persist_due(self, step: int) -> bool:
        if self._last_queued is None or (self.persist_every_steps is None and self.persist_every_seconds is None):
            return True
        queued_step, queued_at = self._last_queued
        return (self.persist_every_steps is not None and step - queued_step >= self.persist_every_steps) or (
            self.persist_every_seconds is not None and self._clock() - queued_at >= self.persist_every_seconds
        )

    def _persist_queued(self) -> None:
        while True:
            with self._persist_lock:
                item, self._persist_next = self._persist_next, None
                if item is None:
                    self._persisting, self._persist_loop = None, None
                    return
                self._persisting = item[0].step
            self._copy_to_storage(*item)

    def _copy_to_storage(self, info: CheckpointInfo, manifest: bytes) -> None:
        """Copy a memory checkpoint's files to storage, unchanged, then its manifest (the commit); rotate."""
        began = time.perf_counter()
        directory = self._tier.path(info.step)
        try:
            self._clear_step_dir(info.uri, info.step)
            for name in sorted(info.files or {}):
                self._storage.upload(os.path.join(directory, name), _join(info.uri, name))
            self._storage.write_bytes(_join(info.uri, MANIFEST_NAME), manifest, atomic=True)
        except Exception as exc:  # noqa: BLE001 - never into training: the next memory checkpoint tries again
            self.failed_persists += 1
            logger.error(
                "checkpoint step %d (committed in memory) could not be copied to %s: %s",
                info.step,
                info.uri,
                _describe(exc),
                exc_info=True,
            )
            return
        self._trusted[info.uri] = info.manifest_sha256
        self.in_storage = info
        self.last_persist_seconds = time.perf_counter() - began
        self.persists += 1
        logger.info("persisted checkpoint step %d to %s (%.2f s)", info.step, info.uri, self.last_persist_seconds)
        with self._persist_lock:  # the memory tier keeps the newest memory checkpoint and what is queued
            newest = self.in_memory.step if self.in_memory is not None else info.step
            self._tier.remove_older(newest, keep=self._persist_steps() - {info.step})
        self._tier.prepare_spare(
            {name: size for name, size in (info.files or {}).items() if name.endswith(DEFAULT_SUFFIX)}
        )
        try:
            self._rotate()
        except Exception as exc:
            logger.error("checkpoint rotation below %s failed: %s", self.uri, exc, exc_info=True)

    @property
    def persisting(self) -> bool:
        """Rank 0's persister is copying to storage (or about to)."""
        return self._persist_loop is not None

    @property
    def persist_lag_steps(self) -> int:
        """Steps the newest memory checkpoint is ahead of the newest in storage (0 when not persisting behind)."""
        if self.in_memory is None:
            return 0
        return self.in_memory.step - (self.in_storage.step if self.in_storage is not None else 0)

    def flush(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, then wait until rank 0 has persisted the newest memory checkpoint (or failed to);
        the newest checkpoint in storage, the same on every rank. Persisting behind under torch.distributed this is a
        collective: call it on every rank."""
        self.wait()
        if not self.persist_behind:
            return self.in_storage
        with self._persist_lock:
            held_back = self._held_back
        if held_back is not None:
            self._persist(*held_back, whenever=True)
        self.wait_persisted()
        if self._distributed:
            self.in_storage = self._broadcast(self.in_storage)
        return self.in_storage

    def wait_persisted(self) -> None:
        """Wait until this rank's persister (rank 0's) is idle: every copy queued so far is in storage or failed. Not a
        collective, and a checkpoint held back by the storage interval stays held (`flush` copies it)."""
        while True:
            with self._persist_lock:
                loop = self._persist_loop
            if loop is None:
                return
            loop.result()
