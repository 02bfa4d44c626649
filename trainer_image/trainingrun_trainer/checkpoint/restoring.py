"""`Restorer`, the reading side of a store: listing, finding the newest valid checkpoint (from node memory when every
rank holds it), and loading one, verified, into a state."""

from __future__ import annotations

import dataclasses
import pickle
import posixpath
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .context import StoreContext
from .errors import CheckpointLoadError, describe_error, failure_cause
from .layout import EXTRA_ENTRY, LEGACY_EXTRA_FILE, STEP_DIR_NAME, files_a_rank_reads, join_uri, logger
from .manifest import inspect_step, list_step_dirs
from .peers import PeerCopies
from .records import CheckpointInfo
from .safe_load import PlainLoadPlanner, PlainReader, StateMismatch, listed, load_plain
from .storage import Storage
from .tier_files import OWN_MEMORY, PEER, STORAGE, LocalFirstFileSystem, TierMismatch

#: Every rank's extra state entry: each rank reads only its own (a strict load does not miss the others').
_EXTRA_ENTRIES = re.compile(EXTRA_ENTRY.format(rank=r"\d+"))


class Restorer:
    """`list`, `latest_valid` and `load` of one store's checkpoints. `tier_of_rank0`: whether this rank shares rank 0's
    memory tier (rank 0 keeps there what it verifies from storage)."""

    def __init__(self, context: StoreContext, tier_of_rank0: bool):
        self._context = context
        self._tier_of_rank0 = tier_of_rank0
        self._read_from_storage: Optional[str] = None  # the checkpoint latest_valid() last read from storage
        self._peers = PeerCopies(context)
        self._from_peer: Optional[str] = None  # the checkpoint this pod's memory last received from another pod's
        # The checkpoint latest_valid() found in every pod's memory, its files in storage only listed: a load of it
        # reads no file from storage unverified (`LocalFirstFileSystem.storage_verified`).
        self._held_in_memories: Optional[str] = None
        #: After latest_valid(): the newest step directory below uri that another run wrote, when it found none newer
        #: of this run's (None: none).
        self.another_runs_newest: Optional[CheckpointInfo] = None

    def list(self, verify: bool = True) -> list[CheckpointInfo]:
        """Every step directory below the store's uri, newest step first, valid or not. With
        ``verify`` (default) every file is re-hashed; without, only presence and sizes are checked.
        Works on any single rank (no collective)."""
        return [
            inspect_step(self._context.storage, uri, step, deep=verify)
            for step, uri in list_step_dirs(self._context.storage, self._context.uri)
        ]

    def _find_latest_valid(self, in_memory: Optional[CheckpointInfo] = None) -> Optional[CheckpointInfo]:
        """The newest valid checkpoint, re-hashing every file in storage (and keeping what it read in the memory
        tier, for the load that follows); `in_memory` is one every rank holds verified in its memory tier: its files
        in storage are only checked for presence and size."""
        if in_memory is not None:  # listed a moment ago, and every newer directory lacked a manifest or files
            self._context.trust(in_memory)
            return in_memory
        for step, uri in list_step_dirs(self._context.storage, self._context.uri):
            info = inspect_step(
                self._context.storage, uri, step, deep=True, tier=self._context.tier, owner=self._context.run_uid
            )
            if info.valid:
                self._context.trust(info)
                return info
            if self._context.another_runs(info) and self.another_runs_newest is None:
                self.another_runs_newest = info
            logger.warning("skipping checkpoint %s: %s", uri, info.reason)
        return None

    def latest_valid(self) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose files match its manifest (every file re-hashed, also the
        ones this process wrote), or None; invalid newer directories are skipped with a warning.
        When every rank's memory tier holds the newest committed checkpoint, its files in storage are only listed:
        :meth:`load` checks the memory copies as it reads them and falls back to storage, verified, for a damaged one.

        Finishes the save in flight first. Under torch.distributed this is a collective: call it
        on every rank; rank 0 verifies and broadcasts the answer, so every rank resumes from the
        same checkpoint."""
        in_memory = self._held_in_memory()
        self.another_runs_newest = None
        result: Union[CheckpointInfo, Exception, None] = None
        if not self._context.ranks.distributed:
            result = self._find_latest_valid(in_memory)
        else:
            if self._context.ranks.rank == 0:
                try:
                    result = self._find_latest_valid(in_memory)
                except Exception as exc:
                    result = exc
            result, self.another_runs_newest = self._context.ranks.broadcast((result, self.another_runs_newest))
            if isinstance(result, Exception):
                raise result
            if result is not None:
                self._context.trust(result)  # verified by rank 0: no rank re-hashes it
        self._read_from_storage = None
        self._context.in_memory = result
        if in_memory is None:  # else `_held_in_memory` found the newest in storage
            self._context.in_storage = result
        if self._context.tier is not None and in_memory is None:
            # Rank 0 read it from storage just now, keeping it in its node's memory tier: a load there reads storage,
            # even where the bytes come from that copy; and every rank checks the tier again.
            if result is not None and self._tier_of_rank0:
                self._read_from_storage = result.uri
            self._context.tier.forget()
        return result

    def _held_in_memory(self) -> Optional[CheckpointInfo]:
        """The newest committed checkpoint (by its manifest, files not re-hashed) when every rank's memory tier holds
        all of its files (by `MemoryTier.files`); else None. Persisting behind, that is the tier's newest memory
        checkpoint when storage holds none as new. A collective under torch.distributed when the store has a tier."""
        if self._context.tier is None:
            return None
        received = self._peers.share_newest()
        self._from_peer = None if received is None else self._context.step_uri(received)
        newest: Any = None
        if self._context.ranks.rank == 0:
            likely = self._context.tier.newest_step()
            try:
                newest = self._newest_committed(likely)
            except Exception as exc:  # storage unreachable: the resume that follows says so
                logger.debug("listing %s for the memory tier failed: %s", self._context.uri, exc)
            self._context.in_storage = newest
            if self._context.persist_behind and likely is not None and (newest is None or newest.step < likely):
                newest = self._in_memory_only(likely) or newest
        newest = self._context.ranks.broadcast(newest)
        held = newest is not None and self._holds_what_this_rank_reads(newest)
        found = newest if self._context.ranks.all(held)[0] else None
        stored = self._context.in_storage  # rank 0's only: the others do not know what storage holds
        if (
            self._context.ranks.rank == 0
            and found is None
            and newest is not None
            and (stored is None or stored.step < newest.step)
        ):
            logger.warning(
                "checkpoint step %d, which only memory holds, is not in every pod's memory as its ranks read it (a pod "
                "lacks files and no surviving pod could give them): resuming from storage's newest instead",
                newest.step,
            )
        self._held_in_memories = None if found is None else found.uri
        return found

    def _holds_what_this_rank_reads(self, info: CheckpointInfo) -> bool:
        """Whether this rank's memory tier holds every file of `info` it reads to restore it (`files_a_rank_reads`)."""
        tier = self._context.held_tier()
        if info.files is None:
            return tier.holds_all(info.step, info.manifest_sha256)
        found = tier.files(info.step, info.manifest_sha256)
        ranks = self._context.ranks
        needed = files_a_rank_reads(info.files, info.world_size, ranks.world_size, ranks.rank)
        return bool(found) and needed <= found.keys()

    def _in_memory_only(self, step: int) -> Optional[CheckpointInfo]:
        """The tier's checkpoint of `step`, committed in memory and not (yet) in storage, by its manifest there; None
        when the tier is another store's, or was made before the storage it belongs to was deleted or replaced (its
        `origin`: the storage URI and the token storage holds, `storage_identity`)."""
        tier = self._context.held_tier()
        origin = tier.origin_of_tier()
        if origin != tier.origin:
            logger.warning(
                "the memory tier %s holds checkpoints of %s, not of %s as it is now (another run's, or made before "
                "that storage was deleted or replaced): ignoring its step %d",
                tier.root,
                (origin or "an unknown store").split("#")[0],
                self._context.uri,
                step,
            )
            return None
        directory = tier.path(step)
        # Every rank then checks that its pod's memory holds what it reads (`_holds_what_this_rank_reads`): on more
        # than two pods of a sharded state no pod's holds every file.
        found = inspect_step(
            Storage(directory, {}), directory, step, deep=False, owner=self._context.run_uid, partial=True
        )
        if not found.valid:
            logger.warning("the checkpoint of step %d kept in memory is not usable: %s", step, found.reason)
            return None
        return dataclasses.replace(
            found, uri=self._context.step_uri(step), size_bytes=sum((found.files or {}).values())
        )

    def _newest_committed(self, likely: Optional[int]) -> Optional[CheckpointInfo]:
        """The newest checkpoint in storage with a manifest and all of its files (not re-hashed). Step `likely` (the
        one this node's memory tier holds) is looked at while the directory is listed: on an object store a restart
        inside the pod then waits for one round trip instead of two."""
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-list") as pool:
            early = (
                None
                if likely is None
                else pool.submit(
                    inspect_step,
                    self._context.storage,
                    self._context.step_uri(likely),
                    likely,
                    deep=False,
                    owner=self._context.run_uid,
                )
            )
            for step, uri in list_step_dirs(self._context.storage, self._context.uri):
                info = (
                    early.result()
                    if early is not None and step == likely
                    else inspect_step(self._context.storage, uri, step, deep=False, owner=self._context.run_uid)
                )
                if info.valid:
                    return info
        return None

    def load(self, info_or_uri: Union[CheckpointInfo, str], state: dict, strict: bool = False) -> dict:
        """Load a checkpoint into ``state`` in place (DCP: tensors are copied into the tensors
        already in ``state``, resharding as needed; Stateful objects get ``load_state_dict``) and
        return this rank's ``extra`` dict ({} with a warning when the checkpoint was written by
        fewer ranks). Under torch.distributed, call on every rank. A state that asks for entries the
        checkpoint lacks raises `StateMismatch` saying how they differ; with `strict`, so does one that
        leaves entries of the checkpoint unread (an optimizer's empty state before its first step).

        Every file is re-hashed against the manifest first, and a ValueError raised if it is not a
        committed checkpoint, unless this process wrote or verified this very manifest (a
        CheckpointInfo from :meth:`latest_valid` was: then storage is not even listed again). Files read from the
        memory tier are checked as they are read; a damaged one is read again from storage (OSError when storage
        does not verify either).
        """
        began = time.perf_counter()
        uri = info_or_uri.uri if isinstance(info_or_uri, CheckpointInfo) else str(info_or_uri).rstrip("/")
        match = STEP_DIR_NAME.fullmatch(posixpath.basename(uri))
        if not match:
            raise ValueError(f"{uri!r} is not a checkpoint directory (expected .../step-NNNNNNNN)")
        if (
            isinstance(info_or_uri, CheckpointInfo)
            and info_or_uri.valid
            and info_or_uri.manifest_sha256
            and info_or_uri.files is not None
            and self._context.trusted.get(uri) == info_or_uri.manifest_sha256
        ):
            info = info_or_uri  # this process wrote or verified this very manifest: no storage round trips again
        else:
            info = inspect_step(
                self._context.storage, uri, int(match.group(1)), deep=True, trusted=self._context.trusted
            )
        if not info.valid:
            raise ValueError(f"{uri} is not a valid checkpoint: {info.reason}")
        entry = EXTRA_ENTRY.format(rank=self._context.ranks.rank)
        if entry in state:
            raise ValueError(f"state key {entry!r} is reserved for this rank's extra state: rename it")
        legacy = info.format_version == 1
        reading = LocalFirstFileSystem(
            self._context.tier.files(info.step, info.manifest_sha256) if self._context.tier else {},
            self._context.storage.local,
            storage_verified=uri != self._held_in_memories,
        )
        try:
            loading, planner = self._read(info, state, entry, legacy, reading)
        except CheckpointException as exc:  # a BaseException: make it an error that says what failed
            # A copy in memory that did not match, or was gone, on any rank (DCP's own fallbacks may hide the cause,
            # as its metadata read does): every rank reads it again from storage.
            mismatch = bool(reading.mismatched) or any(
                isinstance(failure_cause(failure), TierMismatch) for failure in exc.failures.values()
            )
            if self._context.ranks.all(not mismatch)[0]:  # no rank's copy in memory failed
                differs = next(
                    (c for c in map(failure_cause, exc.failures.values()) if isinstance(c, StateMismatch)), None
                )
                if differs is not None:
                    raise StateMismatch(f"cannot load {uri}: {differs}") from None
                raise CheckpointLoadError(f"cannot load {uri}: {describe_error(exc)}") from None
            loading, planner = self._read_again_from_storage(uri, info, state, entry, legacy, exc, reading)
        if strict and planner.unread:
            raise StateMismatch(
                f"cannot load {uri} whole: the state passed leaves {len(planner.unread)} of its entries unread "
                f"{listed(planner.unread)}: pass everything the save had; an optimizer's state_dict() is empty before "
                "its first step, so pass the optimizer itself (Run.resume makes its state in full)"
            )
        state.update({key: loading[key] for key in state})  # as dcp.load(state) would: Stateful -> its dict
        if legacy:
            if planner.missing:
                logger.info(
                    "%s (format 1) has no entries %s: left as they were", uri, ", ".join(sorted(planner.missing))
                )
            raw, source = (
                self._legacy_extra(info),
                join_uri(uri, LEGACY_EXTRA_FILE.format(rank=self._context.ranks.rank)),
            )
        else:
            raw, source = (None if entry in planner.missing else loading[entry]), f"{uri} ({entry})"
        if raw is None:
            logger.warning("%s has no extra state for rank %d (saved by fewer ranks)", uri, self._context.ranks.rank)
            extra: dict = {}
        else:
            try:
                extra = load_plain(raw)
            except pickle.UnpicklingError as exc:
                raise CheckpointLoadError(
                    f"cannot load {source}: it holds more than plain values "
                    f"(refusing to run code from storage): {exc}".splitlines()[0]
                ) from None
        self._count_restore(uri, reading, time.perf_counter() - began)
        return extra

    def _count_restore(self, uri: str, reading: LocalFirstFileSystem, seconds: float) -> None:
        """The load's figures: where its bytes came from, as the files were read (`reading`), but that this pod's
        memory received them just before, from storage (rank 0's verifying download) or from another pod's memory."""
        metrics = self._context.metrics
        metrics.last_restore_seconds = seconds
        sources, read = set(reading.sources), dict(reading.read_bytes)
        if uri == self._read_from_storage:
            sources, read = {"storage"}, {OWN_MEMORY: 0, PEER: 0, STORAGE: sum(read.values())}
        elif uri == self._from_peer and "memory" in sources:
            sources = (sources - {"memory"}) | {"peer"}
            read = {OWN_MEMORY: 0, PEER: read[OWN_MEMORY] + read[PEER], STORAGE: read[STORAGE]}
        metrics.last_restore_source = " and ".join(sorted(sources))
        metrics.last_restore_bytes = read
        for source, count in read.items():
            metrics.restore_bytes[source] = metrics.restore_bytes.get(source, 0) + count
        metrics.restores += 1

    def _read(
        self, info: CheckpointInfo, state: dict, entry: str, legacy: bool, reading: LocalFirstFileSystem
    ) -> tuple[dict, PlainLoadPlanner]:
        """dcp.load of the verified checkpoint `info`, reading only the files its manifest lists (`reading`: which files
        come from the memory tier; it records where it read): (what was loaded, the planner)."""
        loading = dict(state) if legacy else {**state, entry: b""}
        # Format 1 kept what its writer saved per rank outside DCP: entries such a checkpoint lacks stay as they are.
        planner = PlainLoadPlanner(
            optional=set(state) if legacy else {entry}, ignored=lambda fqn: _EXTRA_ENTRIES.fullmatch(fqn) is not None
        )
        reader = PlainReader(info.uri, info.files, **self._context.options)
        reading.inner, reader.fs = reader.fs, reading  # type: ignore[assignment]  # serves what DCP's reader calls
        dcp.load(
            loading,
            storage_reader=reader,
            planner=planner,
            process_group=self._context.ranks.group,
            no_dist=not self._context.ranks.distributed,
        )
        return loading, planner

    def _read_again_from_storage(
        self,
        uri: str,
        info: CheckpointInfo,
        state: dict,
        entry: str,
        legacy: bool,
        failed: CheckpointException,
        reading: LocalFirstFileSystem,
    ) -> tuple[dict, PlainLoadPlanner]:
        """A rank found a file of its memory tier damaged as it loaded (every rank is here: DCP gathered the failure):
        rank 0 checks the checkpoint in storage, whose files were only listed when the tiers held it, keeping what it
        reads in its tier for the next restart; then every rank loads again, reading the files its tier failed
        (`reading.mismatched`) from storage. Raises OSError when storage does not verify either: the trainer restarts
        (a retryable exit), and the restart's latest_valid, which no longer finds it in memory, skips it."""
        bad = set(reading.mismatched)
        logger.warning(
            "rank %d: %s: reading it again, %s",
            self._context.ranks.rank,
            describe_error(failed),
            f"{', '.join(sorted(bad))} from storage" if bad else "as another rank's memory copy was damaged",
        )
        checked: Any = None
        if self._context.ranks.rank == 0:
            try:
                checked = inspect_step(self._context.storage, uri, info.step, deep=True, tier=self._context.tier)
            except Exception as exc:
                checked = exc
        checked = self._context.ranks.broadcast(checked)
        if isinstance(checked, Exception) or not checked.valid:
            if self._context.tier is not None:  # damaged, and nowhere else: the restart must not find it again
                self._context.tier.discard(info.step)
            why = describe_error(checked) if isinstance(checked, Exception) else checked.reason
            raise OSError(
                f"cannot load {uri}: its copy in memory is damaged and storage is not readable or not "
                f"valid ({why}); a restart resumes from the newest valid checkpoint"
            )
        kept = {}
        if self._context.tier is not None:
            self._context.tier.forget()
            kept = self._context.tier.files(info.step, info.manifest_sha256)
        again = LocalFirstFileSystem(
            {name: copy for name, copy in kept.items() if name not in bad}, self._context.storage.local
        )
        try:
            loaded = self._read(checked, state, entry, legacy, again)
        except CheckpointException as exc:
            raise CheckpointLoadError(f"cannot load {uri}: {describe_error(exc)}") from None
        reading.sources |= again.sources
        for source, read in again.read_bytes.items():
            reading.read_bytes[source] += read
        return loaded

    def _legacy_extra(self, info: CheckpointInfo) -> Optional[bytes]:
        """This rank's extra state in a format 1 checkpoint: a file of its own (when its manifest lists one)."""
        name = LEGACY_EXTRA_FILE.format(rank=self._context.ranks.rank)
        files = info.files or {}
        if name not in files:
            return None
        try:
            return self._context.storage.read_bytes(join_uri(info.uri, name), limit=files[name])
        except FileNotFoundError:
            return None
