"""`CheckpointStore`: saves (async, committed by the manifest), lists, loads and rotates checkpoints.

The class is put together from one part per concern, each in its module: `saving` (the training thread's side of a
save), `committing` (the checkpoint thread: write, then commit), `persisting` (copies to storage behind node memory),
`restoring` (list, latest_valid, load) and `rotation`. This module holds what they share: the store's state (set up in
`__init__`, documented on the class), collectives, closing, and the run's start count."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ..torch_internals import StateDictStager, forget_save_plans
from .committing import Committing
from .layout import (
    MANIFEST_NAME,
    STARTS_NAME,
    CheckpointInfo,
    PendingSave,
    _join,
    logger,
    step_dir_name,
)
from .manifest import _inspect
from .memory_tier import MemoryTier
from .persisting import PersistingBehind
from .restoring import Restoring
from .rotation import Rotating
from .saving import Saving, _SaveJob
from .storage import _is_dir, _Storage, _storage_options
from .tier_staging import release_locked_pages

#: Numbers the stores of this process: each keeps its own plans in DCP's process-wide plan cache.
_STORES = itertools.count()


class CheckpointStore(Saving, Committing, PersistingBehind, Restoring, Rotating):
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
        # Staging copies tensors into CPU buffers that every save reuses (pinned with CUDA, for fast copies):
        # containers are rebuilt, other values deep-copied.
        self._state_stager = StateDictStager(pin_memory=torch.cuda.is_available())
        self._defer_state_dicts: Optional[bool] = (
            None  # see save(); decided by the first save that copies in the background
        )

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
        nodes = self._gather(f"{socket.gethostname()}:{os.path.realpath(self._tier.root)}") if self._tier else []
        # Whether rank 0, which verifies a checkpoint read from storage and keeps it in its tier, shares this one.
        self._tier_of_rank0 = bool(nodes) and nodes[0] == nodes[self.rank]
        #: Whether saves commit in the memory tier and rank 0 persists them behind (every rank shares one tier).
        self.persist_behind = persist_behind and bool(nodes) and len(set(nodes)) == 1
        if self.persist_behind and self._tier is not None:
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

    def _all(self, *flags: bool) -> list[bool]:
        """Each of `flags` and-ed over the ranks (one all_reduce of a small tensor, no pickling)."""
        if not self._distributed:
            return list(flags)
        agreed = torch.tensor([int(flag) for flag in flags], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._pg)
        return [bool(flag) for flag in agreed.tolist()]

    def _gather_to_first(self, obj: Any) -> list:
        """Every rank's `obj` on rank 0 (in rank order); [] on the other ranks."""
        if not self._distributed:
            return [obj]
        out: Optional[list] = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self._pg, group_dst=0)
        return out or []

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

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
