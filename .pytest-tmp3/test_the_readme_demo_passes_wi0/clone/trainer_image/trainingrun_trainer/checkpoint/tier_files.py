"""The memory tier's files (memory_tier.py keeps them): each data file beside its digests file, written through
`SegmentHasher` and `RecycledFile`, read back through `VerifiedTierFile`, which checks each segment as it loads, and
`LocalFirstFileSystem`, which serves DCP's reader from the tier and from storage what the tier lacks."""

from __future__ import annotations

import io
import json
import mmap
import os
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import xxhash

#: Bytes per checked segment of a tier file: a load that reads part of a file reads at most this much more, to check
#: the segments it touches whole.
SEGMENT_BYTES = 4 << 20
#: Bytes read and hashed at a time when loading: small enough to hash while they are in the CPU's cache.
READ_CHUNK = 1 << 20
#: Suffix of a tier file's digests file.
DIGESTS_SUFFIX = ".xxh3"
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
    #: This process wrote the file from bytes it had just checked against the manifest, and nothing changed it since
    #: (`MemoryTier.vouch`): read without hashing it again.
    vouched: bool = False


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


def tier_file(path: str, entry: dict, digest: str) -> Optional[TierFile]:
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
            if segment not in self._checked and not self._file.vouched:
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


#: Where a restore's bytes came from (`LocalFirstFileSystem.read_bytes`, `trainingrun_checkpoint_restore_bytes_total`):
#: this node's memory tier, another pod's memory (which this node's received just before, `peers`), or storage.
OWN_MEMORY, PEER, STORAGE = "own_memory", "peer", "storage"


class _CountedStream:
    """A stream whose bytes read are added up (`count`); everything else is the stream's own."""

    def __init__(self, stream: Any, count: Any):
        self._stream, self._count = stream, count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def read(self, *args: Any) -> bytes:
        data = self._stream.read(*args)
        self._count(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        done = self._stream.readinto(buffer)
        self._count(done or 0)
        return done


class LocalFirstFileSystem:
    """Wraps DCP's reader FileSystem (`inner`): the files in `local` ({name: `TierFile`}) are read from the memory tier,
    checked as they are read; `sources` says where the files read came from ("memory", "storage"), `read_bytes` how many
    bytes came from each (OWN_MEMORY, STORAGE; PEER is `restoring`'s), `mismatched` names the tier files that failed their
    check. Without `storage_verified` (a checkpoint the pods' memory holds, whose files in storage were only listed) a
    file the tier lacks is not read from storage either: it fails as a damaged one does (TierMismatch), so that it is
    read again once storage is verified."""

    def __init__(self, local: dict[str, TierFile], storage_is_local: bool = False, storage_verified: bool = True):
        self.inner: Any = None  #: the reader's own FileSystem (the reader sets it)
        self._local, self._storage_is_local = local, storage_is_local
        self._storage_verified = storage_verified
        self.sources: set[str] = set()
        self.read_bytes: dict[str, int] = {OWN_MEMORY: 0, PEER: 0, STORAGE: 0}
        self._counting = threading.Lock()  # a large local file is read by several threads (tensor_files.READ_THREADS)
        self.mismatched: set[str] = set()

    def _counter(self, source: str) -> Any:
        def count(n: int) -> None:
            with self._counting:
                self.read_bytes[source] += n

        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reads_locally(self, path: Any) -> bool:
        """Whether `path` is read from this node (its memory tier, or storage on a local disk)."""
        return self._storage_is_local or os.path.basename(os.fspath(path)) in self._local

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = os.path.basename(os.fspath(path))
        local = self._local.get(name)
        if local is None and mode == "rb" and not self._storage_verified:
            self.mismatched.add(name)
            raise TierMismatch(f"{name} is not in this pod's memory, and its copy in storage is not verified yet")
        if local is None or mode != "rb":
            self.sources.add("storage")
            with self.inner.create_stream(path, mode) as stream:
                yield _CountedStream(stream, self._counter(STORAGE)) if mode == "rb" else stream
            return
        self.sources.add("memory")
        try:
            with VerifiedTierFile(local) as stream:
                yield _CountedStream(stream, self._counter(OWN_MEMORY))
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
        self._map: Optional[mmap.mmap] = mapped(self._fd, self._size) if self._size else None
        self._pos = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        end = self._pos + view.nbytes
        if end > self._size:
            self._remap(max(end, self._size + self.GROW))
        assert self._map is not None  # mapped by _remap above when it was empty
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
        self._map = mapped(self._fd, size)

    def __enter__(self) -> "RecycledFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def mapped(fd: int, size: int) -> mmap.mmap:
    """The file shared-mapped with its pages mapped at once (MAP_POPULATE, where there is one): one call instead of a
    page fault per 4 KiB as the write first touches each (0.10 s of a 258 MB write into a recycled file on the 2-core
    VM, the copy itself 0.03 s)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def write_atomically(path: str, data: bytes) -> None:
    partial = f"{path}.{uuid.uuid4().hex}.partial"  # ranks of a node may race here
    try:
        with open(partial, "wb") as out:
            out.write(data)
        os.replace(partial, path)
    except OSError:
        remove_file(partial)
        raise


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
