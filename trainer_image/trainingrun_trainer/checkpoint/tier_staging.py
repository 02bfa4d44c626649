"""Stage once: a rank's CPU tensors copied straight into its data file in the memory tier, which the save then
completes in place.

Staging into buffers and then writing the buffers into the tier copies every byte twice. Here the tier's data file is
the staging buffer: `StagedFile.stage` copies each tensor into the file's shared mapping (the pages of the spare's
file, `tier_files.SPARE_DIR`, where there is one) and returns the state with views of those bytes in place of the
tensors; training may change its own tensors from then on. DCP then plans the save of the views and
`StagedFile.complete` records where each already lies (no copy), appends what was not staged (byte items, tensors
staged elsewhere) and hashes the file once, from memory: its file digest and the xxh3_128 of each segment.

The file is in format 3 (`tensor_files`): each tensor's bytes at the offset DCP's metadata records, here aligned to
`ALIGN` bytes (so a view of them has its dtype's alignment) with the staged tensors first and the byte items after
them. Readers go by the metadata's offsets and lengths, not by the order.

Plain, strided tensors are staged so (`stageable`), on the CPU or on CUDA devices: a GPU tensor is copied from the
device straight into the file's pages, which are page-locked for the copy (`cudaHostRegister`) so it runs at the
link's speed (copies into pageable memory go through the driver's own small buffers, several times slower). Where the
pages cannot be locked (no room to pin, a runtime without it) the copy goes through pageable memory, the same bytes.
A state with other tensors (DTensor, sharded, quantized) is staged by the store's `StateDictStager` as before.
"""

from __future__ import annotations

import copy
import errno
import mmap
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..torch_internals import StorageInfo
from .layout import FILE_DIGEST, file_hasher
from .tensor_files import RAW_TENSOR, byte_view
from .tier_files import SEGMENT_BYTES, SEGMENTS_KEY, SPARE_DIR

#: Each staged tensor starts at a multiple of this many bytes: a cache line, and every dtype's alignment.
ALIGN = 64
#: Threads that hash a staged file's segments, beside the one that hashes the whole file.
HASH_THREADS = min(8, os.cpu_count() or 1)
#: Values staged as they are (no copy can change them).
_IMMUTABLE = (int, float, bool, str, bytes, type(None))


def data_file_name(rank: int) -> str:
    """The name DCP gives the data file of `rank` (its plan's storage prefix is ``__<rank>_``)."""
    return f"__{rank}_0{DEFAULT_SUFFIX}"


def plain_tensors(tree: Any, device: Optional[str] = None) -> bool:
    """Whether every tensor in `tree` (nested dicts, lists, tuples) is a plain strided tensor (no DTensor, sharded or
    quantized tensor), and on `device` when one is named."""
    if isinstance(tree, torch.Tensor):
        return (
            type(tree) in (torch.Tensor, torch.nn.Parameter)
            and tree.layout == torch.strided
            and not tree.is_quantized
            and (device is None or tree.device.type == device)
        )
    if isinstance(tree, Mapping):
        return all(plain_tensors(value, device) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(plain_tensors(value, device) for value in tree)
    return True


def stageable(tree: Any) -> bool:
    """Whether every tensor in `tree` is a plain strided tensor on the CPU or a CUDA device: what `StagedFile.stage`
    copies."""
    return plain_tensors(tree) and all(tensor.device.type in ("cpu", "cuda") for tensor in tensors_of(tree))


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nested state (dicts, lists, tuples)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [tensor for value in tree.values() for tensor in tensors_of(value)]
    if isinstance(tree, (list, tuple)):
        return [tensor for value in tree for tensor in tensors_of(value)]
    return []


def _key(tensor: torch.Tensor) -> tuple:
    """Two tensors with the same key are the same bytes (tied weights): staged once."""
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def staging_layout(
    tree: Any, planned: Optional[Iterable[torch.Tensor]] = None
) -> tuple[dict[tuple, int], int, list[tuple[int, tuple]]]:
    """Where `StagedFile.stage` puts the tensors of `tree` (only those `planned`, when given): their offsets by
    `_key`, largest first, each at a multiple of `ALIGN`; the end of the last; and every tensor's (bytes, key)."""
    chosen = None if planned is None else {_key(tensor) for tensor in planned}
    offsets: dict[tuple, int] = {}
    end = 0
    sizes = [(tensor.numel() * tensor.element_size(), _key(tensor)) for tensor in tensors_of(tree)]
    for nbytes, key in sorted(sizes, key=lambda size_key: -size_key[0]):  # largest first
        if key not in offsets and (chosen is None or key in chosen):
            offsets[key] = end
            end = _aligned(end + nbytes)
    return offsets, end, sizes


def staged_at(tensor: torch.Tensor, offsets: dict[tuple, int]) -> Optional[int]:
    """Where `staging_layout`'s `offsets` put `tensor` (None: nowhere)."""
    return offsets.get(_key(tensor))


class StagedFile:
    """The data file `path` of one rank in the memory tier, staged into through a shared mapping."""

    def __init__(self, path: str):
        self.path = path
        self.name = os.path.basename(path)
        self.failed = False  #: stage() found no room (or could not write the file): nothing of it is usable
        self._fd = -1
        self._bytes: Optional[torch.Tensor] = None  # uint8 over the mapping
        self._views: dict[tuple, torch.Tensor] = {}
        self.staged_bytes = 0  # the file's bytes that stage() wrote
        self._offsets: dict[tuple, int] = {}  # where stage() put each tensor (by `_key`)
        self.size = 0
        self.pinned = False  #: whether stage() locked the file's pages for copies from a GPU

    def stage(
        self, tree: Any, planned: Optional[Iterable[torch.Tensor]] = None, also_copied: Iterable[torch.Tensor] = ()
    ) -> Any:
        """Copy the tensors of `tree` into the file; `tree` with views of the copies in their place (containers
        rebuilt, other values deep-copied, as a stager does). Raises OSError when node memory lacks room for them
        (before any is copied: a store into a full memory-backed mapping would end the process with SIGBUS).

        `planned`: only these tensors of `tree` go into the file (what this rank's save plan writes); of the others,
        those in `also_copied` are copied into this process's memory (what rank 0's model digest reads) and the rest
        stand in as tensors on the meta device, with their dtype and shape but no data (reading one raises)."""
        outside = {_key(tensor) for tensor in also_copied}
        offsets, end, sizes = staging_layout(tree, planned)
        spare = os.path.join(os.path.dirname(os.path.dirname(self.path)), SPARE_DIR, self.name)
        try:
            os.replace(spare, self.path)  # another save's file, of about the size this one will be: its pages are there
        except OSError:
            pass
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, end)  # a larger spare's pages past the end go
        if end:
            try:
                os.posix_fallocate(self._fd, 0, end)  # ENOSPC here instead of SIGBUS while copying
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: not /dev/shm
                    raise
        self.staged_bytes = self.size = end
        devices = {tensor.device for tensor in tensors_of(tree) if tensor.is_cuda}
        if end and devices:
            self._bytes, self.pinned = _LOCKED.mapping(self._fd, end)
        elif end:
            self._bytes = _mapping(self._fd, end)
        self._offsets = offsets
        try:
            staged = self._stage(tree, offsets, outside)
            self._zero_padding(sizes)
            return staged
        finally:
            for device in devices:  # the copies ran on each device's current stream, after what was queued there
                torch.cuda.current_stream(device).synchronize()

    def _zero_padding(self, sizes: list[tuple[int, tuple]]) -> None:
        """Zeros between the staged tensors: a recycled file's pages hold another save's bytes there, and another pod
        that stages the same tensors into its copy of this file (`mirroring`) must write the same bytes."""
        if self._bytes is None:
            return
        ends = sorted(
            (self._offsets[key], self._offsets[key] + nbytes) for nbytes, key in set(sizes) if key in self._offsets
        )
        at = 0
        for start, end in ends + [(self.staged_bytes, self.staged_bytes)]:
            if start > at:
                self._bytes[at:start].zero_()
            at = max(at, end)

    def _stage(self, tree: Any, offsets: dict[tuple, int], outside: set[tuple]) -> Any:
        if isinstance(tree, torch.Tensor):
            key = _key(tree)
            view = self._views.get(key)
            if view is None and key not in offsets:
                view = _copied(tree) if key in outside else torch.empty_like(tree, device="meta")
                self._views[key] = view
            elif view is None:
                nbytes = tree.numel() * tree.element_size()
                if nbytes:
                    assert self._bytes is not None  # mapped by prepare()
                    target = self._bytes[offsets[key] : offsets[key] + nbytes]
                    target.copy_(_byte_view_tensor(tree), non_blocking=self.pinned)
                    view = target.view(tree.dtype).view(tree.shape)
                else:
                    view = torch.empty(tree.shape, dtype=tree.dtype)
                self._views[key] = view
            return view
        if isinstance(tree, Mapping):
            return {key: self._stage(value, offsets, outside) for key, value in tree.items()}
        if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
            return type(tree)(self._stage(value, offsets, outside) for value in tree)
        if type(tree) in _IMMUTABLE:  # an optimizer's param_groups: hundreds of numbers per save
            return tree
        return copy.deepcopy(tree)

    def _offset_of(self, tensor: torch.Tensor) -> Optional[int]:
        """Where `tensor`'s bytes lie in the file, when it is one of the staged views (or a contiguous part of one)."""
        if self._bytes is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self._bytes.data_ptr()
        if 0 <= offset and offset + tensor.numel() * tensor.element_size() <= self.staged_bytes:
            return offset
        return None

    def complete(self, plan: SavePlan, resolve: Any) -> tuple[list[WriteResult], dict]:
        """DCP's write of this rank's items of `plan` into the file: staged tensors where they lie, the rest appended;
        the write results, and the file's manifest entry less its path (size, file digest, segment digests under
        `SEGMENTS_KEY`)."""
        if f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}" != self.name:
            raise ValueError(
                f"DCP names this rank's data file {plan.storage_data.prefix}0{DEFAULT_SUFFIX}, not "
                f"{self.name}: the staged copy does not match the plan"
            )
        results: list[WriteResult] = []
        appended: list[memoryview] = []
        for item in plan.items:
            data = resolve(item)
            if item.type == WriteItemType.BYTE_IO:
                view, descriptors, offset = data.getbuffer(), None, None
            else:
                offset, descriptors = self._offset_of(data), [RAW_TENSOR]
                if offset is None and data.device.type != "cpu":
                    raise ValueError(f"{item.index.fqn}: a staged tensor must be on the CPU, not {data.device}")
                view = byte_view(data.contiguous()) if offset is None else None  # a staged one lies there already
            if view is not None:
                offset = self.size
                appended.append(view)
                self.size += view.nbytes
            assert offset is not None  # where a staged tensor lies, else where it was appended
            nbytes = view.nbytes if view is not None else data.numel() * data.element_size()
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=nbytes,
                    storage_data=StorageInfo(self.name, offset, nbytes, transform_descriptors=descriptors),
                )
            )
        return results, self._finish(b"".join(appended))  # byte items and what was not staged: small

    def complete_copy(self, byte_items: list[tuple[int, bytes]]) -> dict:
        """This file is a copy of another rank's, its tensors staged where that rank's plan put them (`mirroring`):
        append that rank's byte items, (offset, bytes) as its `complete` wrote them, and hash the file; its manifest
        entry as `complete` gives it. ValueError when they do not follow the staged tensors one after another."""
        at = self.staged_bytes
        for offset, data in sorted(byte_items):
            if offset != at:
                raise ValueError(f"a byte item at {offset}, not {at}: the other rank's file has another layout")
            at += len(data)
        self.size = at
        return self._finish(b"".join(data for _, data in sorted(byte_items)))

    def _finish(self, tail: bytes) -> dict:
        """Write `tail` after the staged tensors and hash the file: its manifest entry less its path."""
        position = self.staged_bytes
        view = memoryview(tail)
        while view.nbytes:
            written = os.pwrite(self._fd, view, position)
            view, position = view[written:], position + written
        file_digest, segments = self._digests(tail)
        return {"size": self.size, FILE_DIGEST: file_digest, SEGMENTS_KEY: segments}

    def _digests(self, tail: bytes) -> tuple[str, list[str]]:
        """The file's digest and its segments' (`SegmentHasher`'s), from memory: the file digest on this thread, the
        segments, which do not depend on each other, on a pool beside it (xxhash lets go of the GIL)."""
        staged = memoryview(self._bytes.numpy()) if self._bytes is not None else memoryview(b"")  # type: ignore[arg-type]
        staged = staged[: self.staged_bytes]

        def segment(start: int) -> str:
            end = min(start + SEGMENT_BYTES, self.size)
            piece: Union[memoryview, bytes]
            if end <= self.staged_bytes:
                piece = staged[start:end]
            else:  # runs into (or lies in) the tail
                piece = bytes(staged[start:]) + tail[max(0, start - self.staged_bytes) : end - self.staged_bytes]
            return xxhash.xxh3_128(piece).hexdigest()

        digest = file_hasher(FILE_DIGEST)
        if self.size <= SEGMENT_BYTES and FILE_DIGEST == "xxh3_128":  # one segment, the whole file: the same digest
            digest.update(staged)
            digest.update(tail)
            whole = digest.hexdigest()
            return whole, [whole] if self.size else []
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="checkpoint-segments") as pool:
            segments = pool.map(segment, range(0, self.size, SEGMENT_BYTES))
            digest.update(staged)
            digest.update(tail)
            return digest.hexdigest(), list(segments)

    def close(self) -> None:
        """Close the file; the mapping stays while views of it live (the staged state's)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._bytes = None
        self._views.clear()


def _mapping(fd: int, size: int) -> torch.Tensor:
    """The first `size` bytes of file `fd`, mapped shared, as a uint8 tensor (which keeps the mapping while views of
    it live)."""
    return torch.frombuffer(
        mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)), dtype=torch.uint8
    )


class LockedMappings:
    """Mappings of tier data files whose pages stay locked for copies from GPUs, by file (inode), for the saves to come.

    Locking (cudaHostRegister) 1.8 GB costs about as much as copying it from the GPU through pageable memory (an H200:
    0.26 s against 0.30); into pages already locked the copy runs at the link's speed (0.04 s). The tier recycles its
    files (the spare's pages become the next save's), so a few files come back save after save: each is locked once.
    A file deleted since, or past the newest `keep`, is unlocked and let go (its pages are freed when the last view
    of them goes)."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._files: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = {}  # (dev, inode) -> (fd, size, pages)

    def mapping(self, fd: int, size: int) -> tuple[torch.Tensor, bool]:
        """File `fd`'s first `size` bytes, mapped; whether its pages are locked (else copies go through pageable
        memory: no CUDA runtime, or it could not lock them)."""
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        self.release(gone_only=True)
        known = self._files.get(key)
        if known is not None and known[1] == size:
            self._files[key] = self._files.pop(key)  # the newest now
            return known[2], True
        if known is not None:
            self._drop(key)
        pages = _mapping(fd, size)
        if not _pin(pages):
            return pages, False
        self._files[key] = (os.dup(fd), size, pages)
        while len(self._files) > self.keep:
            self._drop(next(iter(self._files)))
        return pages, True

    def release(self, gone_only: bool = False) -> None:
        """Unlock and let go of every file's pages (`gone_only`: of the files deleted since they were locked)."""
        for key, (fd, _, _) in list(self._files.items()):
            if not gone_only or os.fstat(fd).st_nlink == 0:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        fd, _, pages = self._files.pop(key)
        _unpin(pages)
        os.close(fd)


#: This process's locked tier files (a process stages one save at a time).
_LOCKED = LockedMappings()


def release_locked_pages() -> None:
    """Let go of the tier files kept locked for copies from GPUs (the store closing)."""
    _LOCKED.release()


def _pin(pages: torch.Tensor) -> bool:
    """Page-lock `pages` (a CPU tensor over a mapping) for copies from GPUs; whether it could."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), pages.numel(), 0)) == 0
    except (RuntimeError, AttributeError):  # no CUDA runtime
        return False


def _unpin(pages: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


def _copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in this process's memory: from a GPU into page-locked memory (torch's host allocator keeps
    such blocks for the next save), the copy queued on the current stream (`stage` waits for it)."""
    if not tensor.is_cuda:
        return tensor.detach().clone()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    copy.copy_(tensor.detach(), non_blocking=True)
    return copy


def _byte_view_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 tensor (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
