"""`CheckpointStore`: saves (async, committed by the manifest), lists, loads and rotates checkpoints, by composing
one part per concern (`saving`, `committing`, `persisting`, `restoring`, `rotation`) over what they share
(`context`)."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Collection, Mapping, Optional, Union

from trainingrun_api import contract
from trainingrun_api.checkpoint_config import CheckpointConfig

from .committing import Committer
from .context import StoreContext, StoreMetrics
from .layout import STARTS_NAME, join_uri, logger
from .memory_tier import MemoryTier
from .persisting import Persister
from .ranks import RankGroup
from .records import CheckpointInfo, PendingSave, SaveOptions
from .restoring import Restorer
from .rotation import Rotation
from .saving import Saver
from .storage import Storage, fsspec_options, storage_identity
from .tier_staging import release_locked_pages


class CheckpointStore:
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
        persist_behind: with a memory tier on every rank, a save commits once every node's tier holds every file of it
            (`wait()` returns then; with several nodes each node's lowest rank also writes the files of the other
            nodes' ranks, `mirroring`), and rank 0 copies the committed files to storage behind it, on a
            thread of its own, newest first: a memory checkpoint made while an older one is still being copied
            supersedes any waiting to be copied (see "Persisting behind" in the package's description). Otherwise,
            and for a save the tier lacks room for, a save commits when storage holds it.

        persist_every_steps, persist_every_seconds: the storage interval (None and None: every memory checkpoint is
            copied): a memory checkpoint that comes sooner after the last one copied is held back; the next supersedes
            it, or `flush` copies it. `set_storage_interval` changes it as the run goes (``storageInterval.steps:
            auto``).

    `from_config` builds one from a TrainingRun's ``spec.checkpoint`` (`CheckpointConfig`), the trainer's way.

    ``in_memory`` and ``in_storage`` are the newest checkpoint this process committed (or resumed) in memory and in
    storage (`latest_valid` sets both); ``persist_lag_steps`` the steps between them; `flush` waits for storage.
    ``metrics`` holds this rank's figures for Prometheus (`context.StoreMetrics`).

    The store is made of one part per concern, each an object with the `context.StoreContext` it shares:
    ``saver`` (the training thread's side of a save), ``committer`` (the checkpoint thread: write, then commit),
    ``persister`` (copies to storage behind node memory), ``restorer`` (list, latest_valid, load) and ``rotation``.

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
        Rotation.check(keep, keep_every)
        uri = uri.rstrip("/") if not uri.rstrip("/").endswith(":") else uri
        self.uri = uri
        self.memory_tier = memory_tier or None
        options = fsspec_options(uri, endpoint_url, storage_options)
        tier = MemoryTier(memory_tier) if memory_tier else None
        ranks = RankGroup(process_group)
        storage = Storage(uri, options)
        if tier is not None:  # the same on every rank: rank 0's read of storage's token (`storage_identity`)
            token = ranks.broadcast(storage_identity(storage, uri) if ranks.rank == 0 else None)
            if token is None:
                logger.warning("node memory is not used: %s cannot be read or written to name it", uri)
                tier = None
            else:
                tier.origin = f"{uri}#{token}"
        # Each rank's node (host and tier) and pod (the downward API's name, else the host's: one in a cluster).
        pod = os.environ.get(contract.POD_NAME) or socket.gethostname()
        placed = ranks.gather((f"{socket.gethostname()}:{os.path.realpath(tier.root)}", pod)) if tier else []
        nodes = [node for node, _ in placed]
        if tier is not None:  # the node's lowest rank alone removes and recycles what the node's memory holds
            tier.retires = nodes.index(nodes[ranks.rank]) == ranks.rank
        # Whether saves commit in the memory tiers and rank 0 persists them behind: every rank has one, and with
        # several nodes each node's tier holds every file (`mirroring`), so rank 0's holds all it copies.
        behind = persist_behind and bool(nodes)
        if behind and tier is not None:
            tier.recycle = True
        self.context = StoreContext(
            uri=uri,
            run_uid=run_uid or None,
            storage=storage,
            options=options,
            tier=tier,
            ranks=ranks,
            persist_behind=behind,
            nodes=nodes,
            pods=[pod for _, pod in placed],
        )
        self.rotation = Rotation(self.context, keep, keep_every)
        self.persister = Persister(self.context, self.rotation, persist_every_steps, persist_every_seconds)
        self.committer = Committer(self.context, self.rotation, self.persister)
        self.saver = Saver(self.context, self.committer)
        # Whether rank 0, which verifies a checkpoint read from storage and keeps it in its tier, shares this one.
        self.restorer = Restorer(self.context, tier_of_rank0=bool(nodes) and nodes[0] == nodes[ranks.rank])
        self._closed = False

    @classmethod
    def from_config(
        cls,
        config: CheckpointConfig,
        *,
        memory_tier: Optional[str] = None,
        run_uid: Optional[str] = None,
        process_group: Any = None,
    ) -> "CheckpointStore":
        """The store of a TrainingRun's ``spec.checkpoint``: every setting read here, once. `memory_tier`: this
        attempt's folder in node memory (None: off), which ``memoryTier`` and the node decide. ``storageInterval.steps:
        auto`` starts by copying every checkpoint until `set_storage_interval` gives the choice."""
        storage = config.storage_interval
        return cls(
            config.uri,
            keep=config.keep,
            keep_every=config.keep_every,
            endpoint_url=config.endpoint_url,
            process_group=process_group,
            memory_tier=memory_tier,
            run_uid=run_uid,
            persist_behind=config.persist_behind,
            persist_every_steps=storage.steps if storage is not None and isinstance(storage.steps, int) else None,
            persist_every_seconds=storage.seconds if storage is not None else None,
        )

    def set_storage_interval(self, every_steps: Optional[int]) -> None:
        """Persisting behind: copy a memory checkpoint to storage once `every_steps` steps passed since the last one
        copied (None: every one, at storage's pace); the seconds of the interval stay as they were."""
        self.persister.every_steps = every_steps

    @property
    def storage_interval(self) -> tuple[Optional[int], Optional[float]]:
        """(steps, seconds) between the checkpoints copied to storage, persisting behind (None, None: every one)."""
        return self.persister.every_steps, self.persister.every_seconds

    @property
    def persist_behind(self) -> bool:
        """Whether saves commit in the memory tiers and rank 0 persists them behind (off from the first save whose
        copies the nodes could not all keep, `committing`)."""
        return self.context.persist_behind

    @property
    def rank(self) -> int:
        return self.context.ranks.rank

    @property
    def world_size(self) -> int:
        return self.context.ranks.world_size

    @property
    def metrics(self) -> StoreMetrics:
        return self.context.metrics

    @property
    def in_memory(self) -> Optional[CheckpointInfo]:
        return self.context.in_memory

    @property
    def in_storage(self) -> Optional[CheckpointInfo]:
        return self.context.in_storage

    @property
    def memory_short(self) -> Optional[tuple[int, list[str]]]:
        """Rank 0: (step, pods) of the last save, the pods (by name) whose memory had no room for it; None while
        no pod ever lacked room."""
        return self.context.memory_short

    @property
    def persisting(self) -> bool:
        """Rank 0's persister is copying to storage (or about to)."""
        return self.persister.busy

    @property
    def persist_lag_steps(self) -> int:
        """Steps the newest memory checkpoint is ahead of the newest in storage (0 when not persisting behind)."""
        if self.in_memory is None:
            return 0
        return self.in_memory.step - (self.in_storage.step if self.in_storage is not None else 0)

    @property
    def another_runs_newest(self) -> Optional[CheckpointInfo]:
        """After latest_valid(): the newest step directory below uri that another run wrote, when it found none newer
        of this run's (None: none)."""
        return self.restorer.another_runs_newest

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
        """`saving.Saver.save`: checkpoint ``state`` as ``<uri>/step-NNNNNNNN``; call on every rank. The keywords are
        `records.SaveOptions`' fields."""
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")
        options = SaveOptions(config_hash, model_digest, blocking, copy_in_background)
        return self.saver.save(step, state, extra, options)

    def wait_copied(self) -> float:
        """`saving.Saver.wait_copied`."""
        return self.saver.wait_copied()

    def wait_committed(self) -> float:
        """`saving.Saver.wait_committed`."""
        return self.saver.wait_committed()

    def wait(self) -> Optional[CheckpointInfo]:
        """`saving.Saver.wait`: the most recent save's outcome, once it is done."""
        return self.saver.wait()

    def flush(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, then wait until rank 0 has persisted the newest memory checkpoint (or failed to);
        the newest checkpoint in storage, the same on every rank. Persisting behind under torch.distributed this is a
        collective: call it on every rank."""
        self.wait()
        if not self.persist_behind:
            return self.in_storage
        self.persister.persist_newest()
        self.context.in_storage = self.context.ranks.broadcast(self.in_storage)
        return self.in_storage

    def wait_persisted(self) -> None:
        """Wait until this rank's persister (rank 0's) is idle: every copy queued so far is in storage or failed. Not a
        collective, and a checkpoint held back by the storage interval stays held (`flush` copies it)."""
        self.persister.wait_idle()

    def rotate(self) -> list[str]:
        """`rotation.Rotation.rotate`, once the save in flight and the copies queued are done."""
        self.wait()
        self.wait_persisted()
        return self.rotation.rotate()

    # ------------------------------------------------------------------ reading

    def list(self, verify: bool = True) -> list[CheckpointInfo]:
        """`restoring.Restorer.list`."""
        return self.restorer.list(verify)

    def latest_valid(self) -> Optional[CheckpointInfo]:
        """`restoring.Restorer.latest_valid`, once the save in flight is done. A collective under torch.distributed."""
        self.wait()
        return self.restorer.latest_valid()

    def load(self, info_or_uri: Union[CheckpointInfo, str], state: dict, strict: bool = False) -> dict:
        """`restoring.Restorer.load`, once the save in flight is done. A collective under torch.distributed."""
        self.wait()
        return self.restorer.load(info_or_uri, state, strict)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Finish the save in flight and stop the background threads. Idempotent."""
        if self._closed:
            return
        self.flush()  # persisting behind, no rank goes on (and removes the node's tier at the end) before rank 0 has
        self.saver.close()
        self.committer.close()
        release_locked_pages()
        self.persister.close()
        self._closed = True

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the run's starts
    def record_start(self, run: str, now: Optional[float] = None) -> tuple[float, int]:
        """Count a start of the run's training processes in ``<uri>/starts.json``: returns (when the run's first
        process started, processes started before this one). A file of another `run` (its uid) is started over.
        Call it from one process per start (rank 0); it reads, then writes, and raises what storage raises."""
        now = time.time() if now is None else now
        uri = join_uri(self.uri, STARTS_NAME)
        try:
            recorded = json.loads(self.context.storage.read_bytes(uri, limit=1 << 16))
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
        if self.context.storage.local:
            os.makedirs(self.context.storage._path(self.uri), exist_ok=True)
        self.context.storage.write_bytes(uri, json.dumps(recorded).encode(), atomic=True)
        return float(recorded["firstStart"]), before
