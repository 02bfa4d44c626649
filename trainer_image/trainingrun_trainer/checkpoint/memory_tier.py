"""The memory tier: the newest committed checkpoint's files, as this node's ranks wrote them, kept in node memory.

A restart inside the pod (torchrun restarting its worker group, Kubeflow restarting a container) finds them in
the pod's memory-backed /dev/shm and loads them from there instead of reading object storage again. A new pod
starts with an empty /dev/shm, so it reads storage: once, as rank 0 verifies the checkpoint, keeping what it reads
here (`manifest._inspect`) for the load that follows and the restarts before the next save.

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
that file from storage instead (`CheckpointStore.load`). Anything else (a stale step, a file cut short by a kill, a
missing file) is read from storage at once. Writing the tier never fails a save: an error or a /dev/shm too full to
keep a reserve for DataLoader workers and NCCL turns the copy off, with one warning.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Optional

import xxhash

from .layout import _STEP_DIR, MANIFEST_NAME, file_digest_name, logger, step_dir_name

#: Free space /dev/shm keeps for DataLoader workers and NCCL: this share of the volume, and at least RESERVE_BYTES.
RESERVE_SHARE = 0.1
RESERVE_BYTES = 64 << 20
#: Bytes per checked segment of a tier file: a load that reads part of a file reads at most this much more, to check
#: the segments it touches whole.
SEGMENT_BYTES = 4 << 20
#: Bytes read and hashed at a time when loading: small enough to hash while they are in the CPU's cache.
READ_CHUNK = 1 << 20
#: Suffix of a tier file's digests file.
DIGESTS_SUFFIX = ".xxh3"
#: Below the root: the storage URI of the store that writes this tier (`MemoryTier.origin`).
ORIGIN_NAME = "origin"
#: Persisting behind, the newest step the tier no longer needs is kept under this name below the root, and the next
#: save writes its data files into those files' memory (`RecycledFile`): writing into a new /dev/shm file costs
#: the kernel a page allocation per 4 KiB (a 258 MB write took 0.9 s on the 2-core VM), overwriting mapped pages does
#: not (0.10 s).
SPARE_DIR = ".spare"


class TierMismatch(OSError):
    """A file of the memory tier is not what was written there (damaged, cut short): read it from storage."""


@dataclass(frozen=True)
class TierFile:
    """A file of the tier whose size and file digest match the manifest being restored; its content is checked as it is
    read (`VerifiedTierFile`)."""

    path: str
    size: int
    segment_bytes: int
    digests: tuple[str, ...]  #: xxh3_128 of each segment, in order


#: The key of a file's record (its manifest entry while it is written) that holds its segment digests (`SegmentHasher`),
#: for files written straight into the tier; not the manifest's.
SEGMENTS_KEY = "segments"


class SegmentHasher:
    """The xxh3_128 of each `SEGMENT_BYTES` of bytes fed in order (the last segment may be shorter)."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self._hash = xxhash.xxh3_128()
        self._in_segment = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, SEGMENT_BYTES - self._in_segment)
            self._hash.update(view[:take])
            self._in_segment += take
            view = view[take:]
            if self._in_segment == SEGMENT_BYTES:
                self._next()

    def finish(self) -> list[str]:
        if self._in_segment:
            self._next()
        return self.digests

    def _next(self) -> None:
        self.digests.append(self._hash.hexdigest())
        self._hash.reset()
        self._in_segment = 0


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
        self.off: Optional[str] = None  #: why writing is off for this process (None: on)
        self._told_no_room = False
        #: manifest sha256 -> ({file name: TierFile} of the files usable for it, files the manifest lists)
        self._usable: dict[str, tuple[dict[str, TierFile], int]] = {}

    # ------------------------------------------------------------ writing (background thread)

    def begin(self, step: int, expected_bytes: int, keep: Collection[int] = ()) -> Optional[str]:
        """The directory this node's ranks write `step` into, or None when the tier is off or lacks room (then older
        steps go, except those in `keep`: one being persisted)."""
        if self.off is not None:
            return None
        directory = self.path(step)
        try:
            os.makedirs(directory, exist_ok=True)
            if self.origin is not None and not self._origin_written:
                _write_atomically(os.path.join(self.root, ORIGIN_NAME), self.origin.encode())
                self._origin_written = True
            self._remove_steps(lambda other: other > step)  # left by saves that never committed (a rollback)
            # A step saved again: its old copy of the manifest goes first, so the directory is never "committed"
            # while its files are rewritten.
            _remove(os.path.join(directory, MANIFEST_NAME))
            usage = shutil.disk_usage(self.root)
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")
            return None
        reserve = max(RESERVE_BYTES, int(usage.total * RESERVE_SHARE))
        if usage.free + self._spare_bytes() < expected_bytes + reserve:
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
            _write_atomically(os.path.join(directory, MANIFEST_NAME), manifest)
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
            "segment_bytes": SEGMENT_BYTES,
            "xxh3_128": segments,
        }
        _write_atomically(os.path.join(directory, name + DIGESTS_SUFFIX), json.dumps(digests).encode())

    def path(self, step: int) -> str:
        """The directory of `step`."""
        return os.path.join(self.root, step_dir_name(step))

    def _remove_steps(self, which: Callable[[int], bool]) -> None:
        # Never the step a rank of this node may be writing: a slower rank still commits the step before.
        doomed = sorted(
            (int(match.group(1)), name)
            for name in os.listdir(self.root)
            if (match := _STEP_DIR.fullmatch(name)) and which(int(match.group(1)))
        )
        if doomed and self.recycle:
            _, newest = doomed.pop()
            spare = os.path.join(self.root, SPARE_DIR)
            try:
                _remove(os.path.join(self.root, newest, MANIFEST_NAME))  # never a step again
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
            if usage.free < sum(sizes.values()) + max(RESERVE_BYTES, int(usage.total * RESERVE_SHARE)):
                return False
            os.makedirs(partial)
            for name, size in sizes.items():
                fd = os.open(os.path.join(partial, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                    if size:  # tmpfs clears allocated pages at their first fault: here, not in the save
                        _mapped(fd, size).close()
                finally:
                    os.close(fd)
            os.rename(partial, spare)  # fails if a retired step became the spare meanwhile (that one serves); replaces
            # an empty one (a save took its files)
            return True
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
            return False

    def _spare_bytes(self) -> int:
        try:
            with os.scandir(os.path.join(self.root, SPARE_DIR)) as entries:
                return sum(entry.stat().st_size for entry in entries if entry.is_file())
        except OSError:
            return 0

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
        if not manifest_sha256:
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
        try:
            names = os.listdir(self.root)
        except OSError:
            return None
        steps = [
            int(match.group(1))
            for name in names
            if (match := _STEP_DIR.fullmatch(name)) and os.path.exists(os.path.join(self.root, name, MANIFEST_NAME))
        ]
        return max(steps, default=None)

    def forget(self) -> None:
        """Drop what was found looking at the tier (it was written since)."""
        self._usable = {}

    def holds_all(self, step: int, manifest_sha256: Optional[str]) -> bool:
        """Whether every file of that checkpoint is here, by `files`."""
        found = self.files(step, manifest_sha256)
        return bool(found) and len(found) == self._usable[manifest_sha256][1]

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
            kept = _tier_file(path, entry, digest)
            if kept is None:
                logger.warning("%s does not match the manifest of step %d: reading it from storage", path, step)
            else:
                found[entry["path"]] = kept
        return found, len(listed)


def _tier_file(path: str, entry: dict, digest: str) -> Optional[TierFile]:
    """The tier's copy at `path` of the manifest's `entry`, if its size and its digests file's file digest (`digest`,
    the manifest's) match."""
    try:
        with open(path + DIGESTS_SUFFIX, "rb") as f:
            digests = json.loads(f.read())
        segment_bytes, segments = int(digests["segment_bytes"]), tuple(digests["xxh3_128"])
        if (
            os.path.getsize(path) != entry["size"]
            or digests["size"] != entry["size"]
            or digests["file_digest"] != [digest, entry[digest]]
            or segment_bytes <= 0
            or len(segments) != -(-entry["size"] // segment_bytes)
        ):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return TierFile(path, entry["size"], segment_bytes, segments)


class VerifiedTierFile(io.RawIOBase):
    """A tier file opened for DCP's reader, its content checked as it is read: every segment a read touches is hashed
    whole (the bytes of it before or after the read are read too) and compared with its recorded xxh3_128 when the
    read leaves it or `finish` is called, before the load completes. A segment that does not match, or a file that ends
    early, raises `TierMismatch`; the bytes already put into tensors are then loaded again, from storage."""

    def __init__(self, tier_file: TierFile):
        super().__init__()
        self._file = tier_file
        try:
            self._fd = os.open(tier_file.path, os.O_RDONLY)
        except OSError as error:  # gone since it was found (the tier is node memory anyone may clear): read storage
            raise TierMismatch(f"{tier_file.path}: {error.strerror or error}") from None
        self._pos = 0
        self._checked: set[int] = set()  # segments that matched
        self._segment = -1  # the segment being hashed (-1: none)
        self._hash = xxhash.xxh3_128()
        self._hashed_to = 0  # the file offset up to which that segment went into the hash

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._file.size}[whence] + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(view.nbytes, self._file.size - self._pos))
        done = 0
        while done < wanted:
            start = self._pos + done
            segment = start // self._file.segment_bytes
            end = min(self._pos + wanted, self._segment_end(segment), start + READ_CHUNK)
            chunk = view[done : done + end - start]
            self._read_exactly(chunk, start)
            if segment not in self._checked:
                self._hash_read(segment, start, chunk)
            done += end - start
        self._pos += done
        return done

    def finish(self) -> None:
        """Check the segment the last read ended in (the rest of it is read)."""
        if self._segment >= 0:
            self._hash_up_to(self._segment_end(self._segment))
            self._check_segment()

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()

    def _segment_end(self, segment: int) -> int:
        return min((segment + 1) * self._file.segment_bytes, self._file.size)

    def _hash_read(self, segment: int, start: int, chunk: memoryview) -> None:
        if segment != self._segment:
            self.finish()
            self._segment, self._hashed_to = segment, segment * self._file.segment_bytes
            self._hash.reset()
        self._hash_up_to(start)  # the bytes of the segment before the read
        if start + chunk.nbytes > self._hashed_to:
            self._hash.update(chunk[self._hashed_to - start :])
            self._hashed_to = start + chunk.nbytes
        if self._hashed_to == self._segment_end(segment):
            self._check_segment()

    def _hash_up_to(self, offset: int) -> None:
        while self._hashed_to < offset:
            gap = memoryview(bytearray(min(READ_CHUNK, offset - self._hashed_to)))
            self._read_exactly(gap, self._hashed_to)
            self._hash.update(gap)
            self._hashed_to += gap.nbytes

    def _check_segment(self) -> None:
        segment, self._segment = self._segment, -1
        if self._hash.hexdigest() != self._file.digests[segment]:
            first = segment * self._file.segment_bytes
            raise TierMismatch(
                f"{self._file.path}: bytes {first}-{self._segment_end(segment)} differ from what was written there"
            )
        self._checked.add(segment)

    def _read_exactly(self, target: memoryview, offset: int) -> None:
        done = 0
        while done < target.nbytes:
            read = os.preadv(self._fd, [target[done:]], offset + done)
            if not read:
                raise TierMismatch(f"{self._file.path}: ends at {offset + done} bytes, {self._file.size} were written")
            done += read


class LocalFirstFileSystem:
    """Wraps DCP's reader FileSystem (`inner`): the files in `local` ({name: `TierFile`}) are read from the memory tier, checked
    as they are read; `sources` says where the files read came from ("memory", "storage"), `mismatched` names the
    tier files that failed their check."""

    def __init__(self, local: dict[str, TierFile], storage_is_local: bool = False):
        self.inner: Any = None  #: the reader's own FileSystem (the reader sets it)
        self._local, self._storage_is_local = local, storage_is_local
        self.sources: set[str] = set()
        self.mismatched: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reads_locally(self, path: Any) -> bool:
        """Whether `path` is read from this node (its memory tier, or storage on a local disk)."""
        return self._storage_is_local or os.path.basename(os.fspath(path)) in self._local

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        local = self._local.get(name)
        if local is None or mode != "rb":
            self.sources.add("storage")
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        self.sources.add("memory")
        try:
            with VerifiedTierFile(local) as stream:
                yield stream
                stream.finish()
        except TierMismatch:
            self.mismatched.add(name)
            raise


class RecycledFile:
    """A data file written straight into the tier through a shared mapping, into the pages of the spare's file of the
    same name when there is one (`SPARE_DIR`; moved here first), else of a new file; cut to what was written at close.
    The stream DCP's writer writes (`write`, `tell`)."""

    GROW = 64 << 20  #: at least this much more is mapped when a write goes past the end

    def __init__(self, path: str):
        spare = os.path.join(os.path.dirname(os.path.dirname(path)), SPARE_DIR, os.path.basename(path))
        try:
            os.replace(spare, path)  # another save's file, of about the size this one will be
        except OSError:
            pass
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size
        self._map: Optional[mmap.mmap] = _mapped(self._fd, self._size) if self._size else None
        self._pos = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        end = self._pos + view.nbytes
        if end > self._size:
            self._remap(max(end, self._size + self.GROW))
        self._map[self._pos : end] = view
        self._pos = end
        return view.nbytes

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._map is not None:
            self._map.close()
        os.ftruncate(self._fd, self._pos)
        os.close(self._fd)
        self._fd = -1

    def _remap(self, size: int) -> None:
        if self._map is not None:
            self._map.close()
        os.ftruncate(self._fd, size)
        self._size = size
        self._map = _mapped(self._fd, size)

    def __enter__(self) -> "RecycledFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _mapped(fd: int, size: int) -> mmap.mmap:
    """The file shared-mapped with its pages mapped at once (MAP_POPULATE, where there is one): one call instead of a
    page fault per 4 KiB as the write first touches each (0.10 s of a 258 MB write into a recycled file on the 2-core
    VM, the copy itself 0.03 s)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


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
        if self.file is not None:
            digests = {
                "size": self._size,
                "file_digest": [digest_name, digest],
                "segment_bytes": SEGMENT_BYTES,
                "xxh3_128": self._segments.finish(),
            }
            try:
                self.file.close()
                os.replace(self.path + ".partial", self.path)
                _write_atomically(self.path + DIGESTS_SUFFIX, json.dumps(digests).encode())
            except OSError as error:
                self._drop(error)
            self.file = None

    def abandon(self) -> None:
        """The upload failed: no copy."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None
            _remove(self.path + ".partial")

    def _drop(self, error: OSError) -> None:
        self.abandon()
        if self.path is not None:
            _remove(self.path)  # renamed before its digests failed to be written: unusable, and it takes room
        self.tier.turn_off(f"{type(error).__name__}: {error}")


def _write_atomically(path: str, data: bytes) -> None:
    partial = f"{path}.{uuid.uuid4().hex}.partial"  # ranks of a node may race here
    try:
        with open(partial, "wb") as out:
            out.write(data)
        os.replace(partial, path)
    except OSError:
        _remove(partial)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
