"""DCP's fsspec FileSystem, wrapped so every file written is hashed on its way (its manifest entry: size and file
digest, and for files written into the memory tier each segment's digest) and copied into the memory tier. Used by
the writer (`writer`).
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from .layout import FILE_DIGEST, file_hasher
from .memory_tier import MemoryTier, TierCopy
from .tier_files import SEGMENTS_KEY, RecycledFile, SegmentHasher

#: Writes are passed on and hashed in pieces of this many bytes, the hashing on a thread of its own (xxhash releases
#: the interpreter lock): the digests of one piece are computed while the next is written.
PIECE_BYTES = 16 << 20


class HashingStream:
    """Passes writes to a DCP output stream and keeps the size and file digest (`FILE_DIGEST`) of what went through
    (and a copy for the memory tier, `TierCopy`); with `segments`, also the xxh3_128 of each of its segments (a file
    written straight into the memory tier, which checks them as it loads). Once a piece (`PIECE_BYTES`) has gone
    through, the hashing runs on a thread beside the writes, in order."""

    def __init__(self, raw: Any, copy: TierCopy, segments: bool = False):
        self._raw = raw
        self._copy = copy
        self._digest = file_hasher(FILE_DIGEST)
        self._segments = SegmentHasher() if segments else None
        self._hashing: Optional[ThreadPoolExecutor] = None
        self._hashed: list[Future] = []
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._hashing is None and self.size + view.nbytes >= PIECE_BYTES:
            self._hashing = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
        for start in range(0, view.nbytes, PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            self._raw.write(piece)
            self._copy.write(piece)
            if self._hashing is not None:
                self._hashed.append(self._hashing.submit(self._hash, piece))
            else:
                self._hash(piece)
        self.size += view.nbytes
        return view.nbytes

    def _hash(self, piece: memoryview) -> None:
        self._digest.update(piece)
        if self._segments is not None:
            self._segments.update(piece)

    def manifest_entry(self) -> dict:
        """The file's entry in the manifest, less its path (and its `SEGMENTS_KEY`, which is not the manifest's)."""
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)
            for done in self._hashed:
                done.result()
        entry = {"size": self.size, FILE_DIGEST: self._digest.hexdigest()}
        if self._segments is not None:
            entry[SEGMENTS_KEY] = self._segments.finish()
        return entry

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, seekable...
        return getattr(self._raw, name)


class HashingFileSystem:
    """Wraps DCP's fsspec FileSystem: records {basename: manifest entry} of every file DCP writes, and copies it
    into the memory tier's `tier_dir` (None: no copy), following DCP's rename of ``.metadata.tmp`` to ``.metadata``.
    `segments`: also record each file's segment digests (for files written into the memory tier itself)."""

    def __init__(
        self, inner: Any, record: dict, tier: Optional[MemoryTier], tier_dir: Optional[str], segments: bool = False
    ):
        self._inner = inner
        self._record = record
        self._tier, self._tier_dir = tier or MemoryTier(""), tier_dir
        self._segments = segments

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        if not any(ch in mode for ch in "wa+"):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = posixpath.basename(os.fspath(path))
        copy = self._tier.copy(self._tier_dir, name)
        # A data file written straight into the memory tier goes into recycled pages (`RecycledFile`).
        opened = (
            RecycledFile(os.fspath(path))
            if self._segments and name.endswith(DEFAULT_SUFFIX)
            else self._inner.create_stream(path, mode)
        )
        try:
            with opened as stream:
                tee = HashingStream(stream, copy, self._segments)
                yield tee
        except BaseException:
            copy.abandon()  # the upload failed, so does the save
            raise
        entry = tee.manifest_entry()
        copy.close(FILE_DIGEST, entry[FILE_DIGEST])
        self._record[name] = entry

    def rename(self, path, new_path) -> None:
        self._inner.rename(path, new_path)
        self._tier.rename(self._tier_dir, posixpath.basename(os.fspath(path)), posixpath.basename(os.fspath(new_path)))
        record = self._record.pop(posixpath.basename(os.fspath(path)), None)
        if record is not None:
            self._record[posixpath.basename(os.fspath(new_path))] = record
