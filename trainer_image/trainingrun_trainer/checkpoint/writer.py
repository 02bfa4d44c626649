"""The DCP writer that hashes every file as it is written, for the manifest, and copies it to the memory tier."""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.futures import Future as TorchFuture

from ..torch_internals import FsspecWriter
from .layout import FILE_DIGEST, file_hasher
from .memory_tier import SEGMENTS_KEY, MemoryTier, RecycledFile, SegmentHasher, TierCopy
from .tensor_files import write_rank_file
from .tier_staging import StagedFile
from .writer_process import WriteRequest, WriterProcess

#: Writes are passed on and hashed in pieces of this many bytes, the hashing on a thread of its own (xxhash releases
#: the interpreter lock): the digests of one piece are computed while the next is written.
PIECE_BYTES = 16 << 20


class _HashingStream:
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


class _HashingFileSystem:
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
                tee = _HashingStream(stream, copy, self._segments)
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


class _Writer(FsspecWriter):
    """DCP's FsspecWriter writing format 3's data files (`tensor_files`), hashing every file written and, on the
    coordinator, removing a stale directory of the same step while planning (before any rank writes data). With a
    `process`, this rank's data files are written by that writer process (`writer_process`); with a `staged` file
    (`tier_staging`), this rank's data file is the one its state was staged into, completed in place."""

    def __init__(
        self,
        path: str,
        record: dict,
        on_global_plan,
        *,
        sync_files: bool,
        tier: Optional[MemoryTier] = None,
        tier_dir: Optional[str] = None,
        process: Optional[WriterProcess] = None,
        die_after_items: Optional[int] = None,
        segments: bool = False,
        staged: Optional[StagedFile] = None,
        **storage_options,
    ):
        super().__init__(path, sync_files=sync_files, overwrite=True, **storage_options)
        self.fs = _HashingFileSystem(self.fs, record, tier, tier_dir, segments)
        self._on_global_plan = on_global_plan
        self._record, self._tier, self._tier_dir = record, tier, tier_dir
        self._request = dict(
            uri=path, options=storage_options, sync_files=sync_files, die_after_items=die_after_items, segments=segments
        )
        self._process = process
        self._staged = staged

    def write_data(self, plan, planner) -> TorchFuture:
        done: TorchFuture = TorchFuture()
        if self._staged is not None:
            results, self._record[self._staged.name] = self._staged.complete(plan, planner.resolve_data)
            done.set_result(results)
            return done
        if self._process is None:
            done.set_result(
                write_rank_file(
                    self.fs.create_stream, self.fs.concat_path, self.path, plan, planner.resolve_data, self.sync_files
                )
            )
            return done
        data = {item.index: planner.resolve_data(item) for item in plan.items}
        tier_root = self._tier.root if self._tier is not None and self._tier_dir is not None else None
        results, record = self._process.write(
            WriteRequest(plan=plan, data=data, tier_root=tier_root, tier_dir=self._tier_dir, **self._request)
        )
        self._record.update(record)
        done.set_result(results)
        return done

    def _metadata_exists(self) -> bool:
        # DCP warns about an existing .metadata ("overwriting since overwrite=True ...") before
        # planning; re-saving a step is legitimate here and the coordinator clears the stale
        # directory in prepare_global_plan, before anything is written.
        return False

    def prepare_global_plan(self, plans):
        self._on_global_plan()
        return super().prepare_global_plan(plans)


# --------------------------------------------------------------------------------------------
