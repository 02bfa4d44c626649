"""`Persister`: persisting behind, rank 0 copies checkpoints committed in the memory tier to storage, newest first,
on a thread of its own (see "Persisting behind" in the package's description).

Where no pod holds every file (a sharded state on more than two pods, `mirroring`) the copy is spread over the pods
(`spread_over_pods`): each pod's lead copies the files its own pod's ranks wrote (rank 0's pod also the metadata and
the replicated items), and rank 0 writes the manifest, the commit in storage, once every pod's part is there. Rank 0
decides at each commit in memory which checkpoint the pods copy (`plan_parts`), one at a time, and the commit's
broadcast tells every lead: so every pod copies the same checkpoints, and a newer one supersedes the others alike.
Each lead says which part it finished in the next commit's gathered statuses, so storage commits one memory interval
after its slowest part is there, with no collective or polling of its own; `settle_parts` (flush, every rank) waits
for them at once."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from .context import StoreContext
from .errors import describe_error
from .layout import MANIFEST_NAME, file_digest_name, join_uri, logger, writing_rank
from .manifest import MAX_MANIFEST_BYTES
from .records import CheckpointInfo
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
        #: Spread over the pods (`spread_over_pods`): whether a file of a checkpoint is this pod's to copy. None: rank 0
        #: copies every file and the manifest.
        self._part_of: Optional[Callable[[str], bool]] = None
        #: A pod's lead, spread over the pods: (step, whether it reached storage) of the last part it copied; each
        #: commit's gathered statuses carry it to rank 0.
        self.part_done: Optional[tuple[int, bool]] = None
        #: Rank 0, spread over the pods: the checkpoint whose parts the pods' leads copy, its manifest, and when it
        #: was planned (`clock`).
        self._planned: Optional[tuple[CheckpointInfo, bytes, float]] = None
        #: Rank 0, spread over the pods: the manifest's write, once every part was there (`wait_idle` waits for it).
        self._storage_commit: Optional[Future] = None
        self._leads: list[int] = []  # each pod's lead, spread over the pods
        self._superseding = False  # rank 0, spread: the one held back was due, and waits for the pods' copies

    @property
    def spread(self) -> bool:
        """Whether each pod's lead copies its own pod's part of every checkpoint (`spread_over_pods`)."""
        return self._part_of is not None

    def spread_over_pods(self, leads: list[int]) -> None:
        """Every rank, when no pod holds every file of a checkpoint (`mirroring`; `leads`: each pod's lowest rank):
        from now on each pod's lead copies the files its own pod's ranks wrote, and rank 0 writes the manifest once
        every part is in storage (`plan_parts`)."""
        context = self._context
        nodes, rank = context.nodes, context.ranks.rank
        self._part_of = lambda name: writing_rank(name) < len(nodes) and nodes[writing_rank(name)] == nodes[rank]
        self._leads = list(leads)
        if rank in leads and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-persist")

    def plan_parts(
        self, info: Optional[CheckpointInfo], manifest: bytes, parts: list, whenever: bool = False
    ) -> Optional[CheckpointInfo]:
        """Rank 0, spread over the pods, at a commit in memory of `info` (None: at a flush), with each rank's
        `part_done` (`parts`, in rank order; a lead's, None for the others): commit in storage the checkpoint planned
        before once every lead copied its part (its manifest written on rank 0's persister thread), then plan `info`
        when no other is being copied and the storage interval is up (`whenever`: the one held back, at a flush). The
        checkpoint every lead is now to copy its part of (the commit's broadcast tells them), or None."""
        assert self._pool is not None and self._part_of is not None, "rank 0 plans the parts, spread over the pods"
        if self._planned is not None:
            planned, planned_manifest, since = self._planned
            done = [parts[lead] for lead in self._leads]
            if all(part is not None and part[0] == planned.step for part in done):
                self._planned = None
                if all(part[1] for part in done):
                    self._storage_commit = self._pool.submit(self._commit_in_storage, planned, planned_manifest, since)
                else:
                    self._context.metrics.failed_persists += 1
                    logger.error(
                        "checkpoint step %d (committed in memory) is not in storage: a pod could not copy its part "
                        "(see that pod's log)",
                        planned.step,
                    )
        if info is None:
            if not whenever or self._held_back is None or self._planned is not None:
                return None
            info, manifest = self._held_back
        with self._lock:
            if self._superseding and self._held_back is not None and self._held_back[0].step < info.step:
                self._context.metrics.superseded_persists += 1
                logger.info(
                    "checkpoint step %d is not persisted: step %d supersedes it (storage is slower than the "
                    "checkpoint interval)",
                    self._held_back[0].step,
                    info.step,
                )
            self._superseding = False
            if not whenever and not self._due(info.step):
                self._held_back = (info, manifest)
                return None
            if self._planned is not None:  # the pods still copy an older one: the next due supersedes this one
                self._held_back, self._superseding = (info, manifest), True
                return None
            self._held_back = None
            self._last_queued = (info.step, self.clock())
            self._planned = (info, manifest, self.clock())
        return info

    def copy_part(self, info: CheckpointInfo) -> None:
        """A pod's lead, spread over the pods: copy this pod's part of `info` to storage, on the persister thread."""
        assert self._pool is not None and self._part_of is not None, "a pod's lead copies its part"
        with self._lock:
            self._next = (info, b"")
            if self._loop is None:
                self._loop = self._pool.submit(self._copy_queued)

    def settle_parts(self, flushing: bool) -> None:
        """Every rank, spread over the pods (a collective): wait until every lead copied the part it was copying, and
        commit it in storage (rank 0); `flushing`: then do the same for the newest memory checkpoint the storage
        interval held back, so that storage holds the newest."""
        ranks = self._context.ranks
        for _ in range(2 if flushing else 1):
            self.wait_idle()
            parts = ranks.gather_to_first(self.part_done)
            planned = self.plan_parts(None, b"", parts, whenever=flushing) if ranks.rank == 0 else None
            planned = ranks.broadcast(planned)
            if planned is None:
                break
            if self._pool is not None:
                self.copy_part(planned)
        self.wait_idle()

    def persist_newest(self) -> None:
        """Every rank, persisting behind (a collective when spread over the pods): storage gets the newest memory
        checkpoint, the one the storage interval held back included; returns once it is there or failed."""
        if self.spread:
            self.settle_parts(flushing=True)
            return
        if self._context.ranks.rank == 0:
            self.queue_held_back()
        self.wait_idle()

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
        assert self._pool is not None and self._part_of is None, "rank 0 of a store that persists behind copies all"
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
        """Wait until every copy queued so far is in storage or failed (a checkpoint held back stays held), and rank 0's
        manifest of the last one whose parts every pod copied is written."""
        while True:
            with self._lock:
                loop = self._loop
            if loop is None:
                break
            loop.result()
        if self._storage_commit is not None:
            self._storage_commit.result()

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
        """Copy a memory checkpoint's files to storage, unchanged, then its manifest (the commit); rotate. Spread over
        the pods: only this pod's part, with no manifest (rank 0 writes it once every part is there, `plan_parts`)."""
        context, tier, metrics = self._context, self._context.held_tier(), self._context.metrics
        began = time.perf_counter()
        directory = tier.path(info.step)
        part_of = self._part_of
        names = [name for name in sorted(info.files or {}) if part_of is None or part_of(name)]
        try:
            digests = _file_digests(info, manifest, directory)
            if part_of is None:
                self._rotation.clear_step_dir(info.uri, info.step)
            else:  # the other pods' leads copy their parts into the same directory meanwhile
                self._rotation.drop_manifest(info.uri, info.step)
            for name in names:
                context.storage.upload(os.path.join(directory, name), join_uri(info.uri, name), *digests[name])
            if part_of is None:
                context.storage.write_bytes(join_uri(info.uri, MANIFEST_NAME), manifest, atomic=True)
        except Exception as exc:  # noqa: BLE001 - never into training: the next memory checkpoint tries again
            if part_of is None:
                metrics.failed_persists += 1
            self.part_done = (info.step, False)
            logger.error(
                "checkpoint step %d (committed in memory) could not be copied to %s: %s",
                info.step,
                info.uri,
                describe_error(exc),
                exc_info=True,
            )
            return
        if part_of is None:
            self._persisted(info, began)
        else:
            self.part_done = (info.step, True)
            logger.info(
                "copied this pod's part of checkpoint step %d to %s (%d files, %.2f s)",
                info.step,
                info.uri,
                len(names),
                time.perf_counter() - began,
            )
        with self.steps_held() as held:  # the memory tier keeps the newest memory checkpoint and what is queued
            newest = context.in_memory.step if context.in_memory is not None else info.step
            tier.remove_older(newest, keep=held - {info.step})
        here = set(os.listdir(directory)) if os.path.isdir(directory) else set()
        tier.prepare_spare(
            {name: size for name, size in (info.files or {}).items() if name.endswith(DEFAULT_SUFFIX) and name in here}
        )
        if part_of is None:
            self._rotation.rotate_logging_errors()

    def _commit_in_storage(self, info: CheckpointInfo, manifest: bytes, since: float) -> None:
        """Rank 0's persister thread, spread over the pods, once every pod's part of `info` is in storage: its
        manifest, the commit; rotate."""
        try:
            self._context.storage.write_bytes(join_uri(info.uri, MANIFEST_NAME), manifest, atomic=True)
        except Exception as exc:  # noqa: BLE001 - never into training: the next memory checkpoint tries again
            self._context.metrics.failed_persists += 1
            logger.error(
                "checkpoint step %d: every pod copied its part to %s, but the manifest could not be written: %s",
                info.step,
                info.uri,
                describe_error(exc),
                exc_info=True,
            )
            return
        self._persisted(info, since, self.clock)
        self._rotation.rotate_logging_errors()

    def _persisted(self, info: CheckpointInfo, began: float, clock: Callable[[], float] = time.perf_counter) -> None:
        """`info` is committed in storage (its copy began at `began` on `clock`)."""
        metrics = self._context.metrics
        self._context.trust(info)
        self._context.in_storage = info
        metrics.last_persist_seconds = clock() - began
        metrics.persists += 1
        logger.info("persisted checkpoint step %d to %s (%.2f s)", info.step, info.uri, metrics.last_persist_seconds)


def _file_digests(info: CheckpointInfo, manifest: bytes, directory: str) -> dict[str, tuple[str, str]]:
    """{file name: (digest name, digest)} by the committed manifest of `info`: rank 0's own bytes, or (a pod's lead,
    spread over the pods) the memory tier's copy of it once its sha256 is the committed one's. The copy to storage
    checks each file against these as it streams (`Storage.upload`)."""
    if not manifest:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as file:
            manifest = file.read(MAX_MANIFEST_BYTES + 1)
        if hashlib.sha256(manifest).hexdigest() != info.manifest_sha256:
            raise OSError(f"the memory copy of checkpoint step {info.step}'s manifest is not the one committed")
    parsed = json.loads(manifest)
    name = file_digest_name(parsed["format_version"])
    return {entry["path"]: (name, entry[name]) for entry in parsed["files"]}
