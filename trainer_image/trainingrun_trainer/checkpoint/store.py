"""`CheckpointStore`: saves (async, committed by the manifest), lists, loads and rotates checkpoints."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from ..torch_internals import StateDictStager, forget_save_plans
from .layout import (
    _SAVE_ERRORS,
    EXTRA_ENTRY,
    FILE_DIGEST,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STARTS_NAME,
    CheckpointInfo,
    PendingSave,
    _describe,
    _join,
    logger,
    now_rfc3339,
    step_dir_name,
)
from .manifest import _inspect
from .memory_tier import RESERVE_BYTES, RESERVE_SHARE, SEGMENTS_KEY, MemoryTier
from .persisting import PersistingBehind
from .restoring import Restoring
from .rotation import Rotating
from .save_planner import ReusingSavePlanner
from .storage import _is_dir, _Storage, _storage_options
from .tier_staging import StagedFile, data_file_name, plain_tensors, release_locked_pages, stageable
from .writer import _Writer
from .writer_process import WriterProcess

#: Where shared memory lives (torch's shared tensors, the memory tier).
SHARED_MEMORY = "/dev/shm"
#: Numbers the stores of this process: each keeps its own plans in DCP's process-wide plan cache.
_STORES = itertools.count()


@dataclass
class _SaveJob:
    step: int
    state: Any
    config_hash: str
    model_digest: Union[str, Callable[[Mapping[str, Any]], str]]
    started: float
    expected_bytes: int  # about what this rank writes (for the memory tier's room)
    shared: bool = False  # staged in shared memory, for the writer process
    logged: bool = False  # this rank already logged the failure
    later: Optional[dict] = None  # entries of the plain state the background thread stages before writing
    marks: list = field(default_factory=list)  # (phase, perf_counter at its end), for `last_save_phases`
    copied: Future = field(default_factory=Future)  # done when `later` is staged; its exception if that failed


def _plain(state: Mapping[str, Any]) -> dict:
    """`state` with Stateful objects replaced by their state_dict."""
    return {key: (value.state_dict() if isinstance(value, Stateful) else value) for key, value in state.items()}


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors (and byte strings) in a nested state."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(value) for value in tree)
    return len(tree) if isinstance(tree, bytes) else 0


class CheckpointStore(PersistingBehind, Restoring, Rotating):
    """Saves, lists, loads and rotates checkpoints below ``uri`` (gs://, s3://, file:// or a path).

    Args:
        uri: base URI of the run's checkpoints; each step gets ``<uri>/step-NNNNNNNN/``.
        keep: newest valid checkpoints that rotation keeps (>= 1).
        keep_every: also keep every valid checkpoint whose step is a multiple of this.
        endpoint_url: S3-compatible endpoint for s3:// (default ``AWS_ENDPOINT_URL``); for gs://,
            a GCS endpoint such as an emulator.
        process_group: the ranks that checkpoint together (default: all). Under torch.distributed
            the store creates its own gloo group over these ranks for its background collectives,
            so construct the store on every rank at the same point of the program.
        storage_options: extra keyword arguments for the fsspec filesystem (e.g. ``token``).
        memory_tier: a directory in node memory (/dev/shm) where the newest committed checkpoint's files of this
            node's ranks are also kept, for a restart inside the pod to load (see `memory_tier`); None: none.
        writer_process: write this rank's files from a separate process (`writer_process`), staging into shared
            memory buffers that every save reuses; a save that comes before the writer has started, or for which
            /dev/shm lacks room, is written in-process.
        run_uid: the uid of the run whose checkpoints these are, recorded in each manifest: checkpoints another run
            wrote below the same uri (two runs naming one checkpoint.uri) are never resumed from, rotated or
            overwritten (`load` of one named explicitly still reads it). Checkpoints without one (older trainers) are
            taken as this run's. None: every checkpoint is.
        persist_behind: with a memory tier that every rank shares (one node), a save commits once every rank's files
            are in the tier (`wait()` returns then), and rank 0 copies the committed files to storage behind it, on a
            thread of its own, newest first: a memory checkpoint made while an older one is still being copied
            supersedes any waiting to be copied (see "Persisting behind" in the package's description). Otherwise,
            and for a save the tier lacks room for, a save commits when storage holds it.

    Persisting behind, rank 0 also keeps ``in_memory`` and ``in_storage`` (the newest checkpoint this process committed
    in memory and in storage; `latest_valid` sets both), ``persist_lag_steps``, ``failed_persists``,
    ``superseded_persists`` and ``last_persist_seconds``; `flush` waits for storage. ``persist_every_steps`` /
    ``persist_every_seconds`` (the storage interval; None: every memory checkpoint) hold back a memory checkpoint that
    comes sooner after the last one copied: the next supersedes it, or `flush` copies it.

    Metrics of this rank, for Prometheus: ``failed_saves``, ``committed_saves``, ``restores``; ``last_blocking_seconds`` (how long
    ``save()`` held the training loop, including waiting for the previous save);
    ``last_save_seconds`` (staging start to commit); ``last_save_bytes`` (bytes this rank wrote,
    manifest included on rank 0); ``last_restore_seconds`` (last ``load()``); ``last_restore_source``
    ("memory", "storage", or "memory and storage": where the last ``load()`` read its files).

    The store is not thread-safe: call it from the training thread only.
    """

    def __init__(
        self,
        uri: str,
        keep: int = 3,
        keep_every: Optional[int] = None,
        endpoint_url: Optional[str] = None,
        process_group: Any = None,
        *,
        storage_options: Optional[Mapping] = None,
        memory_tier: Optional[str] = None,
        writer_process: bool = False,
        run_uid: Optional[str] = None,
        persist_behind: bool = False,
        persist_every_steps: Optional[int] = None,
        persist_every_seconds: Optional[float] = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be at least 1 or None, got {keep_every}")
        uri = uri.rstrip("/") if not uri.rstrip("/").endswith(":") else uri
        self.uri = uri
        self.keep = keep
        self.keep_every = keep_every
        self.run_uid = run_uid or None
        self._options = _storage_options(uri, endpoint_url, storage_options)
        self._storage = _Storage(uri, self._options)
        self._tier = MemoryTier(memory_tier, origin=uri) if memory_tier else None
        self.memory_tier = memory_tier or None
        self._writer = WriterProcess() if writer_process else None
        if self._writer is not None:
            self._writer.start()  # it imports torch while training starts
        # Staging copies tensors into CPU buffers that every save reuses (pinned with CUDA, for fast copies), in shared
        # memory when the writer process writes them: containers are rebuilt, other values deep-copied.
        self._shared_stager = (
            StateDictStager(share_memory=True, pin_memory=torch.cuda.is_available()) if writer_process else None
        )
        self._private_stager = StateDictStager(pin_memory=torch.cuda.is_available())
        self._shared_bytes = 0  # held by the shared staging buffers
        self._defer_state_dicts: Optional[bool] = (
            None  # see save(); decided by the first save that copies in the background
        )
        self._told_no_shared_room = False
        #: Fault injection (tests): the writer process kills itself part way through the save of this step.
        self.writer_dies_at_step: Optional[int] = None

        self._distributed = dist.is_available() and dist.is_initialized()
        self._pg = None
        self.rank, self.world_size = 0, 1
        if self._distributed:
            if process_group is None:
                self._pg = dist.new_group(backend="gloo")
            else:
                ranks = dist.get_process_group_ranks(process_group)
                self._pg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self.rank = dist.get_rank(self._pg)
            self.world_size = dist.get_world_size(self._pg)
        nodes = self._gather(f"{socket.gethostname()}:{os.path.realpath(memory_tier)}") if self._tier else []
        # Whether rank 0, which verifies a checkpoint read from storage and keeps it in its tier, shares this one.
        self._tier_of_rank0 = bool(nodes) and nodes[0] == nodes[self.rank]
        #: Whether saves commit in the memory tier and rank 0 persists them behind (every rank shares one tier).
        self.persist_behind = persist_behind and bool(nodes) and len(set(nodes)) == 1
        if self.persist_behind:
            self._tier.recycle = True
        self._persister = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-persist")
            if self.persist_behind and self.rank == 0
            else None
        )
        self._persist_lock = threading.Lock()
        self._persist_next: Optional[tuple[CheckpointInfo, bytes]] = None  # newest wins: the next to copy
        self._persisting: Optional[int] = None  # the step being copied
        self._persist_loop: Optional[Future] = None  # the persister's loop, while it runs
        #: Storage interval (None: every memory checkpoint is copied, at storage's pace).
        self.persist_every_steps, self.persist_every_seconds = persist_every_steps, persist_every_seconds
        self._last_queued: Optional[tuple[int, float]] = None  # (step, `_clock` time) of the last queued copy
        self._clock: Callable[[], float] = time.monotonic
        self._held_back: Optional[tuple[CheckpointInfo, bytes]] = None  # newest in memory, before the storage interval
        self.in_memory: Optional[CheckpointInfo] = None
        self.in_storage: Optional[CheckpointInfo] = None
        self.failed_persists = 0
        self.superseded_persists = 0
        self.persists = 0  # copies to storage that succeeded
        self.last_persist_seconds = 0.0

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-checkpoint")
        self._digesting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-model-digest")
        self._pending: Optional[PendingSave] = None
        self._copying: Optional[_SaveJob] = None  # the save whose background copy the caller has not waited for
        self._last_result: Optional[CheckpointInfo] = None
        # uri -> manifest sha256 of checkpoints this process committed or deep-verified.
        self._trusted: dict[str, str] = {}
        # Rotation's verdicts on milestones (keep_every) found valid: their number grows with the run, and every save's
        # rotation would read each one's manifest and listing again. The `keep` newest are few and judged afresh, so
        # one that lost its manifest since is removed as before; a milestone damaged after this process found it valid
        # is left for a later process to judge. Dropped when the directory leaves the listing or is overwritten.
        self._valid_before: dict[str, CheckpointInfo] = {}
        self._read_from_storage: Optional[str] = None  # the checkpoint latest_valid() last read from storage
        #: After latest_valid(): the newest step directory below uri that another run wrote, when it found none newer
        #: of this run's (None: none).
        self.another_runs_newest: Optional[CheckpointInfo] = None
        self._closed = False
        self._manifest_bytes = 0
        self._plans_key = f"trainingrun-checkpoint-store-{next(_STORES)}"  # DCP's plan cache of this store (`_planner`)
        self._planned: dict[str, Any] = {}  # the layout of the state the last finished plan was made from

        self.failed_saves = 0
        self.committed_saves = 0
        self.restores = 0
        self.last_save_seconds = 0.0
        #: Where the last committed save's time went, in seconds: "staging" (from save(), the copy in the background
        #: included), "writing" (DCP: planning, every rank's files), "model digest", "committing" (gathering, the
        #: manifest); writing includes waiting for slower ranks.
        self.last_save_phases: dict[str, float] = {}
        self.last_save_bytes = 0
        self.last_blocking_seconds = 0.0
        self.last_restore_seconds = 0.0
        self.last_restore_source = ""

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        extra: Optional[Mapping[str, Any]] = None,
        *,
        config_hash: str = "",
        model_digest: Union[str, Callable[[Mapping[str, Any]], str]] = "",
        blocking: bool = False,
        copy_in_background: Collection[str] = (),
    ) -> PendingSave:
        """Checkpoint ``state`` as ``<uri>/step-NNNNNNNN``; call on every rank.

        ``state``: a dict for DCP (tensors, DTensors, nested dicts, Stateful objects; use
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` for model + optimizer).
        ``extra``: this rank's own small state of plain values (RNG states...), saved as this rank's
        entry of the same DCP checkpoint (``extra-rank-<r>``). ``config_hash`` and ``model_digest``
        (see :func:`model_digest`) are recorded in the manifest as given ("" = not recorded); ``model_digest`` may be a
        function of the staged state, then rank 0 computes it in the background.

        Finishes the previous save first, then stages (copies) state and extra and returns; the
        write and commit run in the background unless ``blocking``. Never raises a storage error:
        a failed save returns a handle whose ``result()`` is None and counts in ``failed_saves``.

        ``copy_in_background``: keys of ``state`` whose tensors the caller leaves unchanged until it calls
        :meth:`wait_copied` (the trainer: model, optimizer and EMA, which only the next optimizer step changes).
        The background thread copies them while training goes on, and after the first such save (which shows them
        to be plain, unsharded tensors) also takes their state_dict(): leave their structure unchanged too.
        """
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        began = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        reserved = [key for key in state if str(key).startswith(EXTRA_ENTRY.format(rank=""))]
        if reserved:
            raise ValueError(f"state keys {reserved} are reserved for each rank's extra state: rename them")
        # The background thread also takes the state_dict() of what it copies, once the first save has shown them to
        # be plain tensors (not sharded: gathering those may be a collective, which only the training thread may run):
        # torch's get_state_dict walks every module and parameter, milliseconds per save, more the larger the model,
        # and nothing it reads changes before the optimizer step.
        deferred = (
            [key for key in copy_in_background if key in state]
            if not blocking and self._writer is None and self._defer_state_dicts
            else []
        )
        plain = _plain({key: value for key, value in state.items() if key not in deferred})
        expected_bytes = self.last_save_bytes or tensor_bytes(plain)
        shared = self._room_to_share(plain)
        later = (
            {}
            if blocking
            else {key: state[key] if key in deferred else plain.pop(key) for key in copy_in_background if key in state}
        )
        if later and self._defer_state_dicts is None:
            self._defer_state_dicts = plain_tensors(later)
        staged = self._stager(shared)(plain)
        buffer = io.BytesIO()
        torch.save(dict(extra or {}), buffer)
        staged[EXTRA_ENTRY.format(rank=self.rank)] = buffer.getvalue()
        job = _SaveJob(
            step=step,
            state=staged,
            config_hash=config_hash,
            model_digest=model_digest,
            started=started,
            expected_bytes=expected_bytes,
            shared=shared,
            later=later or None,
        )
        if not later:
            job.copied.set_result(None)
        if blocking:
            future: Future = Future()
            future.set_result(self._run(job))
        else:
            future = self._executor.submit(self._run, job)
        self.last_blocking_seconds = time.perf_counter() - began
        pending = PendingSave(step, future, self.last_blocking_seconds)
        self._pending, self._copying = pending, job
        return pending

    def _stager(self, shared: bool) -> Callable[[dict], dict]:
        return (self._shared_stager if shared else self._private_stager).stage

    def wait_copied(self) -> float:
        """Wait until the save in flight has copied its ``copy_in_background`` entries; returns the seconds waited
        (they count in ``last_blocking_seconds`` and the save's ``blocking_seconds``). Call it before changing
        them. Raises what copying raised (out of memory...), as ``save()`` would have."""
        job, self._copying = self._copying, None
        if job is None:
            return 0.0
        began = time.perf_counter()
        error = job.copied.exception()
        waited = time.perf_counter() - began
        self.last_blocking_seconds += waited
        if self._pending is not None:  # the save whose copy this was: set together in save(), wait() keeps the order
            self._pending.blocking_seconds += waited
        if error is not None:
            raise error
        return waited

    def _room_to_share(self, plain: Mapping[str, Any]) -> bool:
        """Whether this save can stage into shared memory for the writer process: /dev/shm must hold what the
        buffers lack and keep its reserve, or copying into them would end the process with SIGBUS."""
        if self._writer is None or not self._writer.ready():
            return False
        needed = max(0, tensor_bytes(plain) - self._shared_bytes)
        if needed:
            try:
                usage = shutil.disk_usage(SHARED_MEMORY)
            except OSError:
                return False
            if usage.free < needed + max(RESERVE_BYTES, int(usage.total * RESERVE_SHARE)):
                if not self._told_no_shared_room:
                    logger.warning(
                        "checkpoints are written in-process, not by the writer process: %s has %d MiB "
                        "free and staging needs %d MiB more (raise resources.sharedMemory); told once",
                        SHARED_MEMORY,
                        usage.free >> 20,
                        needed >> 20,
                    )
                    self._told_no_shared_room = True
                return False
            if not self._shared_bytes:
                logger.info(
                    "rank %d: checkpoint files are written by the writer process %d from now on",
                    self.rank,
                    self._writer.pid,
                )
            self._shared_bytes += needed
        return True

    def wait(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, if any, and return the most recent save's outcome: the
        committed :class:`CheckpointInfo`, or None if it failed (or nothing was saved yet)."""
        self.wait_copied()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last_result = pending.result()
        return self._last_result

    def close(self) -> None:
        """Finish the save in flight and stop the background thread. Idempotent."""
        if self._closed:
            return
        self.flush()  # persisting behind, no rank goes on (and removes the node's tier at the end) before rank 0 has
        self._executor.shutdown(wait=True)
        self._digesting.shutdown(wait=True)
        release_locked_pages()
        if self._persister is not None:
            self._persister.shutdown(wait=True)
        if self._writer is not None:
            self._writer.close()
        forget_save_plans(self._plans_key)
        self._closed = True

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step_uri(self, step: int) -> str:
        return _join(self.uri, step_dir_name(step))

    def _clear_step_dir(self, step_uri: str, step: int) -> None:
        """Coordinator, while DCP plans: remove what an earlier save of this step left (manifest
        first, so the directory is never a committed checkpoint with new data)."""
        listing = self._storage.listing(step_uri)
        if not listing:
            return
        if MANIFEST_NAME in listing and self.run_uid:
            found = _inspect(self._storage, step_uri, step, deep=False)
            if self._another_runs(found):
                raise FileExistsError(
                    f"{step_uri} is a checkpoint of another run (uid {found.run_uid}): two runs "
                    "name the same checkpoint.uri; give each run its own"
                )
        if MANIFEST_NAME in listing:
            logger.warning("overwriting the committed checkpoint %s", step_uri)
            self._storage.rm_file(_join(step_uri, MANIFEST_NAME))
            self._trusted.pop(step_uri, None)
            self._valid_before.pop(step_uri, None)
        for name, entry in listing.items():
            if name == MANIFEST_NAME:
                continue
            if _is_dir(entry):
                self._storage.rm_tree(_join(step_uri, name))
            else:  # a file, or a link: the link goes, never what it points at
                self._storage.rm_file(_join(step_uri, name))

    def _gather(self, obj: Any) -> list:
        if not self._distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

    def _run(self, job: _SaveJob) -> Optional[CheckpointInfo]:
        """Write and commit: in the memory tier when persisting behind and every rank has room there, else to
        storage. Runs on every rank (background thread unless blocking); never raises: errors become a None result, a
        log record and failed_saves."""
        if not self.persist_behind:
            self._stage_later(job, None)
            job.marks.append(("staging", time.perf_counter()))
            return self._save(job, self._tier.begin(job.step, job.expected_bytes) if self._tier else None)
        with self._persist_lock:  # the persister may be taking the next step to copy
            keep = self._persist_steps()
        tier_dir = self._tier.begin(job.step, job.expected_bytes, keep=keep)
        staged = self._stage_later(job, tier_dir)
        job.marks.append(("staging", time.perf_counter()))
        try:
            if staged is not None and staged.failed:
                self._tier.discard(job.step)  # no room after all: this rank's tier gets nothing of this step
                tier_dir = None
            try:
                in_memory = all(self._gather(tier_dir is not None))  # every rank takes the same path
            except _SAVE_ERRORS as exc:
                if tier_dir is not None:
                    self._tier.discard(job.step)  # what was staged there is no checkpoint: free its memory
                return self._failed(job, f"rank {self.rank} lost contact with its peers: {_describe(exc)}")
            if in_memory:
                return self._save(job, tier_dir, in_memory=True, staged=staged)
            if tier_dir is not None:
                self._tier.discard(job.step)
            return self._save(job, None)
        finally:
            if staged is not None:
                staged.close()

    def _stage_later(self, job: _SaveJob, tier_dir: Optional[str]) -> Optional[StagedFile]:
        """Stage the entries save() left to the background (`copy_in_background`), then tell the training thread it
        may change them. Into this rank's data file in `tier_dir` when they are CPU tensors (stage once,
        `tier_staging`; returned), else by the stager."""
        if job.later is None:
            return None
        staged: Optional[StagedFile] = None
        try:
            job.later = _plain(job.later)
            if tier_dir is not None and stageable(job.later):
                staged = StagedFile(os.path.join(tier_dir, data_file_name(self.rank)))
                try:
                    job.state.update(staged.stage(job.later))
                except OSError as exc:
                    logger.warning(
                        "checkpoint step %d: rank %d cannot stage its state in %s (%s): this save commits to storage",
                        job.step,
                        self.rank,
                        tier_dir,
                        _describe(exc),
                    )
                    staged.failed = True
                    staged.close()
            if staged is None or staged.failed:
                job.state.update(self._stager(job.shared)(job.later))
        except BaseException as exc:  # the training thread raises it (wait_copied), as save() would have
            job.copied.set_exception(exc)
            if staged is not None:
                staged.close()
            raise
        finally:
            job.later = None
        job.copied.set_result(None)
        return staged

    def _save(
        self, job: _SaveJob, tier_dir: Optional[str], in_memory: bool = False, staged: Optional[StagedFile] = None
    ) -> Optional[CheckpointInfo]:
        """Write `job` and commit it: to storage, keeping a copy in `tier_dir` (None: none); or, `in_memory`, into
        `tier_dir` alone (completing this rank's `staged` data file, if any), rank 0 then queueing it to be
        persisted."""
        step_uri = self._step_uri(job.step)
        record: dict[str, dict] = {}  # file name -> its manifest entry (size, xxh3_128, ...)
        error: Optional[str] = None
        # From the staged copy, in the background, beside the write (both only read it), so training waits for
        # neither; rank 0 only writes the manifest, so only rank 0 computes it.
        digesting = (
            self._digesting.submit(job.model_digest, job.state)
            if callable(job.model_digest) and self.rank == 0
            else None
        )
        try:
            if in_memory:
                writer = _Writer(
                    tier_dir,
                    record,
                    on_global_plan=lambda: None,
                    sync_files=False,
                    process=self._writer if job.shared and staged is None else None,
                    segments=True,
                    staged=staged,
                    die_after_items=1 if job.step == self.writer_dies_at_step else None,
                )
            else:
                writer = _Writer(
                    step_uri,
                    record,
                    on_global_plan=lambda: self._clear_step_dir(step_uri, job.step),
                    sync_files=self._storage.local,
                    tier=self._tier,
                    tier_dir=tier_dir,
                    process=self._writer if job.shared else None,
                    die_after_items=1 if job.step == self.writer_dies_at_step else None,
                    **self._options,
                )
            dcp.save(
                job.state,
                storage_writer=writer,
                planner=self._planner(),
                process_group=self._pg,
                no_dist=not self._distributed,
            )
            job.marks.append(("writing", time.perf_counter()))
            if in_memory:
                for name, entry in record.items():
                    self._tier.write_digests(
                        tier_dir, name, entry["size"], FILE_DIGEST, entry[FILE_DIGEST], entry.pop(SEGMENTS_KEY)
                    )
        except _SAVE_ERRORS as exc:
            error = _describe(exc)
            logger.error(
                "checkpoint step %d: rank %d could not write %s: %s",
                job.step,
                self.rank,
                tier_dir if in_memory else step_uri,
                error,
                exc_info=True,
            )
            job.logged = True
        if callable(job.model_digest):
            job.model_digest = digesting.result() if digesting is not None and error is None else ""
        job.state = None  # drop the staged copy
        job.marks.append(("model digest", time.perf_counter()))

        outcome: Optional[tuple[Optional[CheckpointInfo], Optional[str], bytes]] = None
        try:
            statuses = self._gather((error, record))
            if self.rank == 0:
                outcome = self._commit(job, step_uri, statuses, tier_dir if in_memory else None)
            outcome = self._broadcast(outcome)
        except _SAVE_ERRORS as exc:  # a collective failed (peer died, timeout)
            outcome = (None, _describe(exc), b"")
            if not job.logged:
                logger.error(
                    "checkpoint step %d: rank %d lost contact with its peers: %s",
                    job.step,
                    self.rank,
                    outcome[1],
                    exc_info=True,
                )
                job.logged = True
        info, commit_error, manifest = outcome
        if tier_dir is not None and info is not None and not in_memory:
            self._tier.commit(job.step, manifest)
        elif tier_dir is not None and info is None:
            self._tier.discard(job.step)
        if info is None:
            return self._failed(job, commit_error)

        self.last_save_seconds = time.perf_counter() - job.started
        job.marks.append(("committing", time.perf_counter()))
        self.last_save_phases = {
            name: at - before for (name, at), (_, before) in zip(job.marks, [("started", job.started)] + job.marks)
        }
        self.last_save_bytes = sum(entry["size"] for entry in record.values())
        self.committed_saves += 1
        if in_memory:
            self.in_memory = info
            self._trusted[step_uri] = info.manifest_sha256  # a load reads it from the tier, checked as it reads
        else:
            self.in_memory = self.in_storage = info
        if self.rank == 0:
            self.last_save_bytes += self._manifest_bytes
            logger.info(
                "committed checkpoint step %d %s (%d bytes, %.2f s)",
                job.step,
                "in memory" if in_memory else f"to {info.uri}",
                info.size_bytes,
                self.last_save_seconds,
            )
            if in_memory:
                self._persist(info, manifest)
            else:
                try:
                    self._rotate()
                except Exception as exc:
                    logger.error("checkpoint rotation below %s failed: %s", self.uri, exc, exc_info=True)
        return info

    def _planner(self) -> ReusingSavePlanner:
        """DCP's planner, reusing this store's last plans while the state's layout is unchanged (`save_planner`)."""
        return ReusingSavePlanner(self._plans_key, self._planned)

    def _failed(self, job: _SaveJob, error: Optional[str]) -> None:
        self.failed_saves += 1
        if not job.logged:  # another rank failed: one record on this rank too
            logger.error("checkpoint step %d was not committed: %s", job.step, error)
        return None

    def _commit(
        self, job: _SaveJob, step_uri: str, statuses: list, tier_dir: Optional[str] = None
    ) -> tuple[Optional[CheckpointInfo], Optional[str], bytes]:
        """Rank 0: write the manifest if every rank succeeded, to storage or (`tier_dir`) into the memory tier.
        Returns (info, error, the manifest's bytes)."""
        self._manifest_bytes = 0
        failed = [(rank, err) for rank, (err, _) in enumerate(statuses) if err is not None]
        if failed:
            return None, "; ".join(f"rank {rank}: {err}" for rank, err in failed), b""
        files = {}
        for _, record in statuses:
            files.update(record)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "time": now_rfc3339(),
            "world_size": self.world_size,
            "config_hash": job.config_hash,
            "model_digest": job.model_digest,
            "torch_version": torch.__version__,
            "files": [{"path": name, **entry} for name, entry in sorted(files.items())],
        }
        if self.run_uid:
            manifest["run_uid"] = self.run_uid
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        try:
            if tier_dir is not None:
                with self._persist_lock:  # older copies go, but not the one being persisted
                    self._tier.commit(job.step, raw, keep=self._persist_steps())
                if self._tier.off is not None:
                    raise OSError(f"the memory tier is off: {self._tier.off}")
            else:
                self._storage.write_bytes(_join(step_uri, MANIFEST_NAME), raw, atomic=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("checkpoint step %d: writing the manifest failed: %s", job.step, error, exc_info=True)
            job.logged = True
            return None, f"rank 0: {error}", b""
        self._manifest_bytes = len(raw)
        manifest_sha = hashlib.sha256(raw).hexdigest()
        if tier_dir is None:
            self._trusted[step_uri] = manifest_sha
        info = CheckpointInfo(
            step=job.step,
            uri=step_uri,
            time=manifest["time"],
            size_bytes=sum(entry["size"] for entry in files.values()) + len(raw),
            valid=True,
            reason=None,
            model_digest=job.model_digest or None,
            world_size=self.world_size,
            manifest_sha256=manifest_sha,
            run_uid=self.run_uid,
            files={name: entry["size"] for name, entry in files.items()},
        )
        return info, None, raw

    # ------------------------------------------------------------------ the run's starts

    def record_start(self, run: str, now: Optional[float] = None) -> tuple[float, int]:
        """Count a start of the run's training processes in ``<uri>/starts.json``: returns (when the run's first
        process started, processes started before this one). A file of another `run` (its uid) is started over.
        Call it from one process per start (rank 0); it reads, then writes, and raises what storage raises."""
        now = time.time() if now is None else now
        uri = _join(self.uri, STARTS_NAME)
        try:
            recorded = json.loads(self._storage.read_bytes(uri, limit=1 << 16))
        except FileNotFoundError:
            recorded = {}
        except ValueError:  # torn by hand or by a bug: count from here
            logger.warning("%s is not JSON: counting the run's starts from this one", uri)
            recorded = {}
        if (
            not isinstance(recorded, dict)
            or recorded.get("run") != run
            or not isinstance(recorded.get("starts"), int)
            or not isinstance(recorded.get("firstStart"), (int, float))
        ):
            recorded = {"run": run, "firstStart": now, "starts": 0}
        before = recorded["starts"]
        recorded["starts"] = before + 1
        if self._storage.local:
            os.makedirs(self._storage._path(self.uri), exist_ok=True)
        self._storage.write_bytes(uri, json.dumps(recorded).encode(), atomic=True)
        return float(recorded["firstStart"]), before
