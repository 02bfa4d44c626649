"""`FileTransfer`: whole files of a memory tier sent from one rank's node to another's over the store's gloo group,
point to point, `CHUNK_BYTES` at a time, each kept by the receiver only when its digest is the one it was told.

Two users: a replacement pod receiving a checkpoint from a surviving pod's memory (`peers`), and, for a sharded state,
each pod receiving the files its neighbour's ranks wrote after a save (`mirroring`). Both sides know beforehand which
files, their sizes and digests; the sender sends exactly that many bytes whatever its copy holds (zeros for what it
lacks), so neither side ever waits for bytes the other will not send, and a damaged or missing copy shows as a digest
that does not match: that file is dropped and its reader falls back to storage.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .layout import file_hasher
from .memory_tier import MemoryTier
from .tier_files import SegmentHasher, mapped, remove_file

#: Bytes sent at a time (one buffer of this size on each side of a copy, two on the sender's).
CHUNK_BYTES = 16 << 20
#: The tags of what the side with the files sends (manifests, files) and of what the receiving side answers: a pod
#: that sends its files to a neighbour while it receives another's (`mirroring`'s ring; on two pods the same one) sends
#: both kinds to one peer from two threads, and gloo matches messages by peer and tag alone.
DATA_TAG, ANSWER_TAG = 0, 1


def chunks(size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each piece of a file of `size` bytes sent at a time."""
    for offset in range(0, size, chunk_bytes):
        yield offset, min(chunk_bytes, size - offset)


class FileTransfer:
    """Files between ranks of `group` (by their rank in it), into and out of `tier`'s directories."""

    def __init__(self, group: Any, tier: MemoryTier):
        self._group = group
        self._tier = tier

    # ------------------------------------------------------------------ small messages

    def put(self, tensor: torch.Tensor, target: int, tag: int = DATA_TAG) -> None:
        dist.send(tensor, group=self._group, group_dst=target, tag=tag)

    def get(self, tensor: torch.Tensor, source: int, tag: int = DATA_TAG) -> None:
        dist.recv(tensor, group=self._group, group_src=source, tag=tag)

    def put_flag(self, flag: bool, target: int) -> None:
        """The receiving side's answer: whether it takes the files."""
        self.put(torch.tensor([int(flag)], dtype=torch.int64), target, ANSWER_TAG)

    def get_flag(self, source: int) -> bool:
        answer = torch.zeros(1, dtype=torch.int64)
        self.get(answer, source, ANSWER_TAG)
        return bool(answer.item())

    def _get_later(self, tensor: torch.Tensor, source: int) -> Any:
        """The receive of `tensor` from `source` started; its `wait()` ends it."""
        receiving = dist.irecv(tensor, group=self._group, group_src=source, tag=DATA_TAG)
        assert receiving is not None  # None only on a rank outside the group
        return receiving

    # ------------------------------------------------------------------ the sender

    def send_files(self, files: list[tuple[str, int]], target: int) -> None:
        """Each (path, size) of `files`, in order: exactly `size` bytes of each."""
        largest = max((size for _, size in files), default=0)
        # Two buffers: one is read into while the other is on its way.
        buffers = [bytearray(min(CHUNK_BYTES, largest) or 1) for _ in range(2)]
        for path, size in files:
            self._send_file(path, size, buffers, target)

    def _send_file(self, path: str, size: int, buffers: list[bytearray], target: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            fd = -1
        in_flight: list[Any] = [None, None]
        try:
            for index, (offset, n) in enumerate(chunks(size, len(buffers[0]))):
                slot = index % 2
                if in_flight[slot] is not None:
                    in_flight[slot].wait()
                view = memoryview(buffers[slot])[:n]
                got = 0
                while fd >= 0 and got < n:
                    try:
                        read = os.preadv(fd, [view[got:]], offset + got)
                    except OSError:  # unreadable now: the receiver finds zeros, and drops the file
                        read = 0
                    if not read:
                        break
                    got += read
                view[got:] = bytes(n - got)
                chunk = torch.frombuffer(buffers[slot], dtype=torch.uint8)[:n]
                in_flight[slot] = dist.isend(chunk, group=self._group, group_dst=target, tag=DATA_TAG)
        finally:
            for sending in in_flight:
                if sending is not None:
                    sending.wait()
            if fd >= 0:
                os.close(fd)

    # ------------------------------------------------------------------ the receiver

    def receive_files(self, directory: str, entries: list[dict], digest_name: str, source: int) -> list[str]:
        """Each file of `entries` (manifest entries: "path", "size" and the `digest_name` digest), in order, from
        `source` into `directory`, its digests file beside it; the names of those not kept (their digest differs, or
        the tier failed), which are removed. Every byte is received either way: the sender sends them all."""
        largest = max((entry["size"] for entry in entries), default=0)
        spill = torch.empty(min(CHUNK_BYTES, largest) or 1, dtype=torch.uint8)
        return [
            entry["path"] for entry in entries if not self._receive_file(directory, entry, digest_name, spill, source)
        ]

    def _receive_file(self, directory: str, entry: dict, digest_name: str, spill: torch.Tensor, source: int) -> bool:
        """One file, received straight into its pages (allocated at once, as `MemoryTier.prepare_spare` does: one page
        fault per 4 KiB cost a 258 MB write 0.1-0.4 s more on the 2-core VM), the next chunk on its way while one is
        hashed; received into `spill` when it cannot be kept."""
        tier = self._tier
        path = os.path.join(directory, entry["path"])
        size = entry["size"]
        hasher, segments = file_hasher(digest_name), SegmentHasher()
        into: Optional[mmap.mmap] = None
        fd = -1
        try:
            fd = os.open(path + ".partial", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            if size:
                os.posix_fallocate(fd, 0, size)
                into = mapped(fd, size)
        except OSError as error:
            tier.turn_off(f"{type(error).__name__}: {error}")
        if into is not None:
            pages = torch.frombuffer(into, dtype=torch.uint8)
            pieces = list(chunks(size, len(spill)))
            receiving = [self._get_later(pages[o : o + n], source) for o, n in pieces[:1]]
            for index, (offset, n) in enumerate(pieces):
                if index + 1 < len(pieces):
                    o, m = pieces[index + 1]
                    receiving.append(self._get_later(pages[o : o + m], source))
                receiving[index].wait()
                with memoryview(into)[offset : offset + n] as view:
                    hasher.update(view)
                    segments.update(view)
            del pages, receiving
        else:
            for _, n in chunks(size, len(spill)):
                self.get(spill[:n], source)
        ready = fd >= 0 and (into is not None or not size)
        kept = ready and tier.off is None and hasher.hexdigest() == entry[digest_name]
        try:
            if into is not None:
                into.close()
            if kept:
                written = os.fstat(fd)
                os.replace(path + ".partial", path)
                tier.write_digests(directory, entry["path"], size, digest_name, entry[digest_name], segments.finish())
                tier.vouch(path, written)
        except OSError as error:
            kept = False
            tier.turn_off(f"{type(error).__name__}: {error}")
        finally:
            if fd >= 0:
                os.close(fd)
            if not kept:
                remove_file(path + ".partial")
                remove_file(path)
        return kept
