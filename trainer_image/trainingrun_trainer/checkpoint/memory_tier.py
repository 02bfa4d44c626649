"""The memory tier: the newest committed checkpoint's files, as this node's ranks wrote them, kept in node memory.

A restart inside the pod (torchrun restarting its worker group, Kubeflow restarting a container) finds them in
the pod's memory-backed /dev/shm and loads them from there instead of reading object storage again. A new pod
starts with an empty /dev/shm, so it reads storage: once, as rank 0 verifies the checkpoint, keeping what it reads
here (`manifest.inspect_step`) for the load that follows and the restarts before the next save.

Layout, below the tier's root (one per attempt of a run, see `contract.memory_tier_dir`)::

    step-NNNNNNNN/<file>            every file this node's ranks wrote for the step, as it streamed to storage
    step-NNNNNNNN/<file>.xxh3       its digests: its size and the manifest's file digest, and the xxh3_128 of each
                                    4 MiB segment
    step-NNNNNNNN/manifest.json     a copy of the committed manifest, written only after storage committed it
                                    (persisting behind: the commit itself; storage gets the same bytes later)
    .spare/                         persisting behind: the newest step no longer needed, whose files the next save
                                    writes into (`RecycledFile`)
    origin                          the storage URI of the store writing here: a checkpoint only in memory is used
                                    by a store of that URI only

Trust: a file is used only when the tier's copy of the manifest is byte for byte the manifest of the checkpoint
being restored and the file has that manifest's size and, by its digests file, its file digest. Its content is checked
as it loads, in one pass: each segment read is hashed while it is still in the CPU's cache and compared with the
xxh3_128 recorded when the copy was written, so a damaged copy fails the load (`TierMismatch`) and the store reads
that file from storage instead (`CheckpointStore.load`). One exception: a file this process wrote from bytes it checked
as it read them from storage (or wrote to storage itself) and that is unchanged since (inode, size, mtime, and ctime,
which a rename or any write through write() sets) loads without a second hash: a new pod's restore verifies each
file while it downloads it into the tier and then loads it from there (hashing it twice made a 258 MB restore from
file:// on the 2-core VM take 0.21-0.22 s, once 0.20 s). Anything else (a stale step, a file cut short by a kill, a
missing file) is read from storage at once. Writing the tier never fails a save: an error or a /dev/shm too full to
keep a reserve for DataLoader workers and NCCL turns the copy off, with one warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from typing import Any, Callable, Collection, Mapping, Optional

from . import tier_files
from .layout import MANIFEST_NAME, STEP_DIR_NAME, file_digest_name, logger, step_dir_name
from .tier_files import (
    DIGESTS_SUFFIX,
    SPARE_DIR,
    SegmentHasher,
    TierFile,
    mapped,
    remove_file,
    tier_file,
    write_atomically,
)

#: Free space /dev/shm keeps for DataLoader workers and NCCL: this share of the volume, and at least RESERVE_BYTES.
RESERVE_SHARE = 0.1
RESERVE_BYTES = 64 << 20
#: Below the root: the storage URI of the store that writes this tier (`MemoryTier.origin`).
ORIGIN_NAME = "origin"


def reserve_bytes(total: int) -> int:
    """What a volume of `total` bytes keeps free beside checkpoint copies. The tier, its spare and the other pods'
    copies (`mirroring`) all ask this one function, read at each call, so one setting moves all three."""
    return max(RESERVE_BYTES, int(total * RESERVE_SHARE))


class MemoryTier:
    """The tier below `root` (created when first written). Used by `CheckpointStore` on its background thread
    (saving) and the training thread (restoring), never both at once."""

    def __init__(self, root: str, recycle: bool = False, origin: Optional[str] = None):
        self.root = root
        #: The storage URI whose checkpoints this process keeps here (written to `ORIGIN_NAME` when it first writes):
        #: a checkpoint only in memory is another store's if the tier says another.
        self.origin = origin
        self._origin_written = False
        #: Keep the newest step no longer needed as the spare whose files the next save overwrites (`SPARE_DIR`).
        self.recycle = recycle
        #: Whether this process decides what the node's memory removes or recycles: the node's
        #: lead only (its lowest rank, which alone persists behind and so alone knows which steps are still being
        #: copied to storage). Another rank that removed by what it holds retired the step its lead was copying, and
        #: its next save wrote into those pages.
        self.retires = True
        self.off: Optional[str] = None  #: why writing is off for this process (None: on)
        #: Whether the last `begin` found no room for its step (the pod named in status.checkpointMemoryShort).
        self.short_of_room = False
        self._told_no_room = False
        #: manifest sha256 -> ({file name: TierFile} of the files usable for it, files the manifest lists)
        self._usable: dict[str, tuple[dict[str, TierFile], int]] = {}
        #: path -> (inode, size, mtime, ctime) of the files this process wrote from bytes checked as they were read
        self._vouched: dict[str, tuple[int, int, int, int]] = {}
        self._swept = False
        #: Whether another user owns the tier's folder: nothing in it is read (`_first_use`).
        self.foreign = False

    def _first_use(self) -> None:
        """At this process's first use of the tier: a tier another user owns is never used (/dev/shm is the
        machine's: one user's run must not read or remove another's). Then the node's lead removes what an earlier
        process of the node left half made (a spare being prepared when it was killed: `<spare>.<id>.partial`), and a
        spare it will not use (one not recycling): each in-place restart after such a kill leaked a checkpoint's worth
        of pod memory."""
        if self._swept:
            return
        self._swept = True
        try:
            owner = os.stat(self.root, follow_symlinks=False).st_uid
        except OSError:
            owner = os.getuid()  # not made yet: this process makes it, its own
        if owner != os.getuid():
            self.foreign = True
            self.turn_off(f"{self.root} belongs to another user (uid {owner})")
            return
        if not self.retires:
            return
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        leftovers = [n for n in names if n.startswith(SPARE_DIR + ".") and n.endswith(".partial")]
        if not self.recycle and SPARE_DIR in names:
            leftovers.append(SPARE_DIR)
        removed = 0
        for name in leftovers:
            path = os.path.join(self.root, name)
            removed += _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            logger.info(
                "removed %d leftover(s) of an earlier process from %s (%d MiB of node memory)",
                len(leftovers),
                self.root,
                removed >> 20,
            )

    # ------------------------------------------------------------ writing (background thread)

    def begin(self, step: int, expected_bytes: int, keep: Collection[int] = ()) -> Optional[str]:
        """The directory this node's ranks write `step` into, or None when the tier is off or lacks room: then older
        steps go, except those in `keep` (one being persisted), when this process `retires` (the node's lead)."""
        self._first_use()
        if self.off is not None:
            return None
        directory = self.path(step)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)  # this user's only
            os.makedirs(directory, exist_ok=True)
            if self.origin is not None and not self._origin_written:
                write_atomically(os.path.join(self.root, ORIGIN_NAME), self.origin.encode())
                self._origin_written = True
            self._remove_steps(lambda other: other > step)  # left by saves that never committed (a rollback)
            # A step saved again: its old copy of the manifest goes first, so the directory is never "committed"
            # while its files are rewritten.
            remove_file(os.path.join(directory, MANIFEST_NAME))
            usage = shutil.disk_usage(self.root)
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")
            return None
        reserve = reserve_bytes(usage.total)
        self.short_of_room = usage.free + self._spare_bytes() < expected_bytes + reserve
        if self.short_of_room:
            self._remove_steps(lambda other: other < step and other not in keep)  # older than what comes: no use
            if not self._told_no_room:
                logger.warning(
                    "checkpoint step %d is not kept in memory: %s has %d MiB free, the copy needs about "
                    "%d MiB and %d MiB stay free for DataLoader workers and NCCL (raise "
                    "resources.sharedMemory); told once",
                    step,
                    self.root,
                    usage.free >> 20,
                    expected_bytes >> 20,
                    reserve >> 20,
                )
                self._told_no_room = True
            return None
        return directory

    def copy(self, directory: Optional[str], name: str) -> "TierCopy":
        return TierCopy(self, None if directory is None else os.path.join(directory, name))

    def rename(self, directory: Optional[str], old: str, new: str) -> None:
        if directory is None or self.off is not None:
            return
        try:
            for suffix in ("", DIGESTS_SUFFIX):
                os.replace(os.path.join(directory, old + suffix), os.path.join(directory, new + suffix))
        except FileNotFoundError:
            pass  # the copy was dropped
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")

    def commit(self, step: int, manifest: bytes, keep: Collection[int] = ()) -> None:
        """`step` is committed (to storage; or, persisting behind, in memory): mark this node's copy committed, then
        drop every older step but those in `keep`."""
        if self.off is not None:
            self.discard(step)  # a copy that failed part way: free what it holds (/dev/shm may be full)
            return
        directory = self.path(step)
        if not os.path.isdir(directory):
            return
        try:
            write_atomically(os.path.join(directory, MANIFEST_NAME), manifest)
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")
            return
        self.remove_older(step, keep)

    def remove_older(self, step: int, keep: Collection[int] = ()) -> None:
        """Drop the steps older than `step` but those in `keep`."""
        self._remove_steps(lambda other: other < step and other not in keep)

    def write_digests(
        self, directory: str, name: str, size: int, digest_name: str, digest: str, segments: list[str]
    ) -> None:
        """The digests file of `name`, a file written straight into `directory` (persisting behind), so a load checks
        it as it reads (`TierFile`). Raises OSError."""
        digests = {
            "size": size,
            "file_digest": [digest_name, digest],
            "segment_bytes": tier_files.SEGMENT_BYTES,
            "xxh3_128": segments,
        }
        write_atomically(os.path.join(directory, name + DIGESTS_SUFFIX), json.dumps(digests).encode())

    def path(self, step: int) -> str:
        """The directory of `step`."""
        return os.path.join(self.root, step_dir_name(step))

    def _remove_steps(self, which: Callable[[int], bool]) -> None:
        # Never the step a rank of this node may be writing: a slower rank still commits the step before.
        if not self.retires:
            return
        doomed = sorted(
            (int(match.group(1)), name)
            for name in os.listdir(self.root)
            if (match := STEP_DIR_NAME.fullmatch(name)) and which(int(match.group(1)))
        )
        if doomed and self.recycle:
            _, newest = doomed.pop()
            spare = os.path.join(self.root, SPARE_DIR)
            try:
                remove_file(os.path.join(self.root, newest, MANIFEST_NAME))  # never a step again
                shutil.rmtree(spare, ignore_errors=True)
                os.replace(os.path.join(self.root, newest), spare)
            except OSError:
                doomed.append((0, newest))
        for _, name in doomed:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def prepare_spare(self, sizes: Mapping[str, int]) -> bool:
        """Persisting behind, while the tier has no spare (the first saves of a process): make one of files of these
        {name: size} (the newest step's data files), their memory allocated now, in the background, so the next save
        writes into pages it need not allocate (`SPARE_DIR`). Only while /dev/shm keeps its reserve beside them.
        Whether one was made."""
        spare = os.path.join(self.root, SPARE_DIR)
        if not self.recycle or self.off is not None or not sizes or self._spare_bytes():
            return False
        partial = f"{spare}.{uuid.uuid4().hex}.partial"
        try:
            usage = shutil.disk_usage(self.root)
            if usage.free < sum(sizes.values()) + reserve_bytes(usage.total):
                return False
            os.makedirs(partial)
            for name, size in sizes.items():
                fd = os.open(os.path.join(partial, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                    if size:  # tmpfs clears allocated pages at their first fault: here, not in the save
                        mapped(fd, size).close()
                finally:
                    os.close(fd)
            os.rename(partial, spare)  # fails if a retired step became the spare meanwhile (that one serves); replaces
            # an empty one (a save took its files)
            return True
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
            return False

    def _spare_bytes(self) -> int:
        return _tree_bytes(os.path.join(self.root, SPARE_DIR))

    def discard(self, step: int) -> None:
        """`step` was not committed: its copy goes."""
        shutil.rmtree(self.path(step), ignore_errors=True)

    def turn_off(self, why: str) -> None:
        if self.off is None:
            logger.warning(
                "checkpoints are no longer kept in memory (%s): %s; restarts read them from storage", self.root, why
            )
            self.off = why

    # ------------------------------------------------------------ restoring (training thread)

    def files(self, step: int, manifest_sha256: Optional[str]) -> dict[str, TierFile]:
        """{file name: `TierFile`} of the checkpoint whose manifest has `manifest_sha256`, for the files this node holds
        with the manifest's size and file digest ({} when its copy of the manifest is another). Reads no file's content:
        that is checked as it loads."""
        self._first_use()
        if not manifest_sha256 or self.foreign:
            return {}
        if manifest_sha256 not in self._usable:
            self._usable = {manifest_sha256: self._find(step, manifest_sha256)}
        return self._usable[manifest_sha256][0]

    def origin_of_tier(self) -> Optional[str]:
        """The storage URI of the store that last wrote this tier (None: not recorded)."""
        try:
            with open(os.path.join(self.root, ORIGIN_NAME), "rb") as f:
                return f.read(4096).decode(errors="replace")
        except OSError:
            return None

    def newest_step(self) -> Optional[int]:
        """The newest step this tier holds a committed copy of (by its copy of the manifest), or None."""
        self._first_use()
        if self.foreign:
            return None
        try:
            names = os.listdir(self.root)
        except OSError:
            return None
        steps = [
            int(match.group(1))
            for name in names
            if (match := STEP_DIR_NAME.fullmatch(name)) and os.path.exists(os.path.join(self.root, name, MANIFEST_NAME))
        ]
        return max(steps, default=None)

    def vouch(self, path: str, written: os.stat_result) -> None:
        """This process wrote the file at `path` (`written`: its fstat after the last write) from bytes it checked
        against a manifest as it read them: a load in this process may skip checking them again while the file is
        unchanged since (the same inode, size and modification time, and no change to it after it was renamed into
        place: its ctime)."""
        try:
            now = _identity(path)
        except OSError:
            return
        if now[:3] == (written.st_ino, written.st_size, written.st_mtime_ns):
            self._vouched[path] = now

    def _still_vouched(self, path: str) -> bool:
        try:
            return path in self._vouched and self._vouched[path] == _identity(path)
        except OSError:
            return False

    def forget(self) -> None:
        """Drop what was found looking at the tier (it was written since)."""
        self._usable = {}

    def holds_all(self, step: int, manifest_sha256: Optional[str]) -> bool:
        """Whether every file of that checkpoint is here, by `files`."""
        found = self.files(step, manifest_sha256)
        return bool(found) and len(found) == self._usable[manifest_sha256 or ""][1]

    def _find(self, step: int, manifest_sha256: str) -> tuple[dict[str, TierFile], int]:
        directory = self.path(step)
        listed: list = []
        digest = ""
        try:
            with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
                raw = f.read()
            if hashlib.sha256(raw).hexdigest() == manifest_sha256:
                manifest = json.loads(raw)
                listed, digest = manifest["files"], file_digest_name(manifest["format_version"])
            else:
                logger.info("the checkpoint of step %d kept in memory is not the committed one: reading storage", step)
        except OSError:
            pass
        found = {}
        for entry in listed:
            path = os.path.join(directory, entry["path"])
            if not os.path.exists(path):
                continue
            kept = tier_file(path, entry, digest)
            if kept is not None and self._still_vouched(path):
                kept = dataclasses.replace(kept, vouched=True)
            if kept is None:
                logger.warning("%s does not match the manifest of step %d: reading it from storage", path, step)
            else:
                found[entry["path"]] = kept
        return found, len(listed)


def _tree_bytes(path: str) -> int:
    """The bytes of the files directly in the folder `path` (a spare holds no folders)."""
    try:
        with os.scandir(path) as entries:
            return sum(entry.stat(follow_symlinks=False).st_size for entry in entries if entry.is_file())
    except OSError:
        return 0


def _identity(path: str) -> tuple[int, int, int, int]:
    stat = os.stat(path)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class TierCopy:
    """One file being written to the tier beside its upload, with its digests (`SegmentHasher`); a write error drops
    the copy, never the upload."""

    def __init__(self, tier: MemoryTier, path: Optional[str]):
        self.tier, self.path, self.file = tier, path, None
        self._segments = SegmentHasher()
        self._size = 0
        if path is not None and tier.off is None:
            try:
                self.file = open(path + ".partial", "wb")
            except OSError as error:
                tier.turn_off(f"{type(error).__name__}: {error}")

    def write(self, data: Any) -> None:
        if self.file is not None:
            try:
                self.file.write(data)
            except OSError as error:
                self._drop(error)
                return
            self._segments.update(data)
            self._size += memoryview(data).nbytes

    def close(self, digest_name: str, digest: str) -> None:
        """The upload of these bytes, whose file digest `digest_name` (the manifest's) is `digest`, succeeded: the copy
        is complete."""
        if self.file is not None and self.path is not None:  # a file is opened only with a path
            digests = {
                "size": self._size,
                "file_digest": [digest_name, digest],
                "segment_bytes": tier_files.SEGMENT_BYTES,
                "xxh3_128": self._segments.finish(),
            }
            try:
                self.file.flush()
                written = os.fstat(self.file.fileno())
                self.file.close()
                os.replace(self.path + ".partial", self.path)
                write_atomically(self.path + DIGESTS_SUFFIX, json.dumps(digests).encode())
            except OSError as error:
                self._drop(error)
            else:
                self.tier.vouch(self.path, written)
            self.file = None

    def abandon(self) -> None:
        """The upload failed: no copy."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None
            if self.path is not None:
                remove_file(self.path + ".partial")

    def _drop(self, error: OSError) -> None:
        self.abandon()
        if self.path is not None:
            remove_file(self.path)  # renamed before its digests failed to be written: unusable, and it takes room
        self.tier.turn_off(f"{type(error).__name__}: {error}")
