"""What the parts of a `CheckpointStore` share: where its checkpoints are (`StoreContext`) and this rank's figures of
them (`StoreMetrics`). Each part (`committing.Committer`, `persisting.Persister`, `restoring.Restorer`,
`rotation.Rotation`) takes the context and what else it needs in its constructor, so it can be built and tested
alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .layout import join_uri, step_dir_name
from .memory_tier import MemoryTier
from .ranks import RankGroup
from .records import CheckpointInfo
from .storage import Storage


@dataclass
class StoreMetrics:
    """This rank's figures of its store, for Prometheus (`trainingrun_trainer.metrics`) and the logs."""

    #: Saves that did not commit (a storage error, a lost peer, no room).
    failed_saves: int = 0
    #: Saves that committed (in memory or in storage).
    committed_saves: int = 0
    #: Loads that finished.
    restores: int = 0
    #: The last committed save, from its staging to its commit, in seconds.
    last_save_seconds: float = 0.0
    #: Where the last committed save's time went, in seconds: "staging" (from save(), the copy in the background
    #: included), "writing" (DCP: planning, every rank's files), "model digest", "committing" (gathering, the
    #: manifest); writing includes waiting for slower ranks.
    last_save_phases: dict[str, float] = field(default_factory=dict)
    #: Bytes this rank wrote in the last committed save (rank 0: the manifest included).
    last_save_bytes: int = 0
    #: How long the last ``save()`` held the training loop, waiting for the save before it included.
    last_blocking_seconds: float = 0.0
    #: How long the last ``load()`` took.
    last_restore_seconds: float = 0.0
    #: Where the last ``load()`` read its files: "memory", "storage" or "memory and storage".
    last_restore_source: str = ""
    #: Bytes the last ``load()`` read, by where they came from (`tier_files.OWN_MEMORY`, `tier_files.STORAGE`).
    last_restore_bytes: dict[str, int] = field(default_factory=dict)
    #: The same, over every ``load()`` of this process (trainingrun_checkpoint_restore_bytes_total{source}).
    restore_bytes: dict[str, int] = field(default_factory=dict)
    #: Persisting behind (rank 0): copies to storage that succeeded, that failed, and memory checkpoints a newer one
    #: replaced before they were copied; and how long the last copy took.
    persists: int = 0
    failed_persists: int = 0
    superseded_persists: int = 0
    last_persist_seconds: float = 0.0


@dataclass
class StoreContext:
    """Where one store's checkpoints are, and what this process already knows of them."""

    #: Base URI of the run's checkpoints (each step in ``<uri>/step-NNNNNNNN/``).
    uri: str
    #: The run's uid recorded in each manifest; checkpoints of another uid are never resumed, rotated or overwritten.
    run_uid: Optional[str]
    storage: Storage
    #: The fsspec filesystem's keyword arguments (DCP's writer and reader take them too).
    options: dict[str, Any]
    #: This node's memory tier (None: none).
    tier: Optional[MemoryTier]
    ranks: RankGroup
    #: Saves commit in the memory tier and rank 0 persists them behind (every rank shares one tier).
    persist_behind: bool
    #: Each rank's node (its host and memory tier), in rank order; [] without a memory tier.
    nodes: list[str] = field(default_factory=list)
    #: Each rank's pod name, in rank order; [] without a memory tier.
    pods: list[str] = field(default_factory=list)
    metrics: StoreMetrics = field(default_factory=StoreMetrics)
    #: uri -> manifest sha256 of the checkpoints this process committed or deep-verified (read without re-hashing).
    trusted: dict[str, str] = field(default_factory=dict)
    #: The newest checkpoint this process committed or resumed, in memory (persisting behind) or storage, and the
    #: newest it knows storage holds.
    in_memory: Optional[CheckpointInfo] = None
    in_storage: Optional[CheckpointInfo] = None
    #: Rank 0: (step, the pods, by name, whose memory had no room for it) of the last save, once one was short
    #: (None until then): status.checkpointMemoryShort.
    memory_short: Optional[tuple[int, list[str]]] = None

    def held_tier(self) -> MemoryTier:
        """The memory tier, where the caller's work needs one (a save in memory, persisting behind, a checkpoint held
        in memory): a store without one never gets there."""
        assert self.tier is not None
        return self.tier

    def trust(self, info: CheckpointInfo) -> None:
        """Record `info` (committed or deep-verified by this process) as read without re-hashing its files."""
        if info.manifest_sha256:
            self.trusted[info.uri] = info.manifest_sha256

    def step_uri(self, step: int) -> str:
        return join_uri(self.uri, step_dir_name(step))

    def another_runs(self, info: CheckpointInfo) -> bool:
        """Whether `info` is a checkpoint another run (another uid) wrote below the same uri."""
        return bool(self.run_uid and info.run_uid and info.run_uid != self.run_uid)
