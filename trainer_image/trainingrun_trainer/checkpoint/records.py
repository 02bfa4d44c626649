"""The records the package's stages pass along: a committed checkpoint (`CheckpointInfo`), a save's handle
(`PendingSave`), how it is asked for (`SaveOptions`), its job on the checkpoint thread (`SaveJob`), each rank's part of it
(`RankPart`) and rank 0's decision (`CommitOutcome`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Union


@dataclass
class CheckpointInfo:
    """One checkpoint directory as found in storage.

    ``valid`` is False when the directory has no manifest or its files do not match it; then
    ``reason`` says why ("no manifest (partial save)", "missing file <f>", "size mismatch in <f>",
    "sha256 mismatch in <f>", "manifest unreadable: ..."). ``time`` is the manifest's commit time
    (RFC 3339, UTC); for a directory without a readable manifest, the newest file's modification
    time when storage reports one, else "". ``size_bytes`` counts every file in the directory.
    ``manifest_sha256`` (sha256 of manifest.json) identifies the committed checkpoint, e.g. in
    the TrainingRun's ``status.lastGoodCheckpoint.sha256``.
    """

    step: int
    uri: str
    time: str
    size_bytes: int
    valid: bool
    reason: Optional[str] = None
    model_digest: Optional[str] = None
    world_size: Optional[int] = None
    manifest_sha256: Optional[str] = None
    format_version: Optional[int] = None
    #: The uid of the run that wrote it (None: not recorded, by trainers before it was).
    run_uid: Optional[str] = None
    #: {plain name: size} of every file the manifest lists (None when it has no readable manifest): the only files
    #: a load of this checkpoint reads.
    files: Optional[dict] = field(default=None, repr=False, compare=False)


class PendingSave:
    """Handle of one save returned by :meth:`CheckpointStore.save`.

    ``step``: the step being saved. ``blocking_seconds``: how long ``save()`` (and
    ``wait_copied()`` after it) blocked its caller.
    ``done()``: whether the save finished (committed or failed). ``result(timeout=None)``: waits
    and returns the committed :class:`CheckpointInfo`, or ``None`` when the save failed; it never
    raises a storage error.
    """

    def __init__(self, step: int, future: "Future[Optional[CheckpointInfo]]", blocking_seconds: float):
        self.step = step
        self.blocking_seconds = blocking_seconds
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional[CheckpointInfo]:
        return self._future.result(timeout)

    def when_done(self, callback: Callable[[Optional[CheckpointInfo]], None]) -> None:
        """Call `callback` with the outcome (as `result()` gives it) as soon as the save finishes, on the thread
        that finished it (or now, on this one, when it already has)."""
        self._future.add_done_callback(lambda future: callback(future.result()))

    def __repr__(self) -> str:
        return f"PendingSave(step={self.step}, done={self.done()})"


@dataclass(frozen=True)
class SaveOptions:
    """How a save is asked for, beside its step, state and extra (`CheckpointStore.save` takes them as keywords)."""

    #: The run's configuration hash, recorded in the manifest ("": not recorded).
    config_hash: str = ""
    #: The model's digest for the manifest (`digest.model_digest`; "": not recorded), or a function of the staged
    #: state that computes it: rank 0 then computes it in the background.
    model_digest: Union[str, Callable[[Mapping[str, Any]], str]] = ""
    #: Write and commit before returning, on the calling thread (else on the checkpoint thread).
    blocking: bool = False
    #: Keys of the state whose tensors the caller leaves unchanged until it calls `wait_copied` (the trainer: model,
    #: optimizer and EMA, which only the next optimizer step changes). The checkpoint thread copies them while
    #: training goes on, and after the first such save (which shows them to be plain, unsharded tensors) also takes
    #: their state_dict(): leave their structure unchanged too.
    copy_in_background: Collection[str] = ()


@dataclass
class SaveJob:
    """One save as the training thread hands it to the checkpoint thread (`saving.Saver` to `committing.Committer`)."""

    #: The training step saved.
    step: int
    #: The staged state (plain, on the CPU); dropped once written.
    state: Any
    #: The run's configuration hash, for the manifest.
    config_hash: str
    #: The model's digest for the manifest, or the function that computes it from the staged state (rank 0).
    model_digest: Union[str, Callable[[Mapping[str, Any]], str]]
    #: time.perf_counter() when save() was called.
    started: float
    #: About what this rank writes (for the memory tier's room).
    expected_bytes: int
    #: This rank already logged the failure.
    logged: bool = False
    #: Entries of the plain state the checkpoint thread stages before writing (`copy_in_background`).
    later: Optional[dict] = None
    #: (phase, perf_counter at its end), for `last_save_phases`.
    marks: list = field(default_factory=list)
    #: Done when `later` is staged; its exception if that failed.
    copied: Future = field(default_factory=Future)
    #: The collective that failed when a peer was gone (`wait_committed`).
    lost_contact: Optional[BaseException] = None


@dataclass
class RankPart:
    """One rank's part of a save, as rank 0 gathers it to commit."""

    #: Why this rank's part is not written (None: written).
    error: Optional[str]
    #: File name -> manifest entry (size, digests) of each file this rank wrote.
    record: dict[str, dict]
    #: This rank's write results for the checkpoint's metadata (or a word that they are the last save's), when every
    #: rank writes by its last plan; else None.
    sent: Any
    #: This pod's memory had no room for its copy (status names such pods).
    short_of_room: bool
    #: Spread persisting: the step this pod's lead last copied its part of, and whether that copy succeeded.
    part_done: Optional[tuple[int, bool]]


@dataclass
class CommitOutcome:
    """What rank 0 decided for a save, broadcast to every rank."""

    #: The committed checkpoint; None: not committed.
    info: Optional[CheckpointInfo]
    #: Why not, naming the ranks that failed.
    error: Optional[str] = None
    #: The manifest as committed (the other pods commit their copies with it).
    manifest: bytes = b""
    #: In memory by the last plan, with several pods: the metadata rank 0 wrote, for the other pods' copies.
    metadata: Optional[bytes] = None
    #: In memory, spread over the pods: the checkpoint every pod's lead is now to copy its part of to storage.
    copy_part: Optional[CheckpointInfo] = None
