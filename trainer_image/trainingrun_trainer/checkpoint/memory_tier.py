"""The memory tier: the newest committed checkpoint's files, as this node's ranks wrote them, kept in node memory.

A restart inside the pod (torchrun restarting its worker group, Kubeflow restarting a container) finds them in
the pod's memory-backed /dev/shm and loads them from there instead of reading object storage again. A new pod
starts with an empty /dev/shm, so it reads storage: once, as rank 0 verifies the checkpoint, keeping what it reads
here (`manifest._inspect`) for the load that follows and the restarts before the next save.

Layout, below the tier's root (one per attempt of a run, see `contract.memory_tier_dir`)::

    step-NNNNNNNN/<file>            every file this node's ranks wrote for the step, as it streamed to storage
    step-NNNNNNNN/manifest.json     a copy of the committed manifest, written only after storage committed it

Trust: a file is used only when the tier's copy of the manifest is byte for byte the manifest of the checkpoint
being restored and the file matches that manifest's size and hash (the xxh3_128 the writer recorded beside the
sha256 of each file it copied here: the same bytes, checked 12 times faster); anything else (a stale step, a file cut
short by a kill, a missing file) is read from storage. Writing the tier never fails a save: an error or a
/dev/shm too full to keep a reserve for DataLoader workers and NCCL turns the copy off, with one warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import xxhash

from .layout import _HASH_CHUNK, _STEP_DIR, MANIFEST_NAME, logger, step_dir_name

#: Free space /dev/shm keeps for DataLoader workers and NCCL: this share of the volume, and at least RESERVE_BYTES.
RESERVE_SHARE = 0.1
RESERVE_BYTES = 64 << 20


class MemoryTier:
    """The tier below `root` (created when first written). Used by `CheckpointStore` on its background thread
    (saving) and the training thread (restoring), never both at once."""

    def __init__(self, root: str):
        self.root = root
        self.off: Optional[str] = None  #: why writing is off for this process (None: on)
        self._told_no_room = False
        #: manifest sha256 -> ({file name: local path} of the files that verified, files the manifest lists)
        self._verified: dict[str, tuple[dict[str, str], int]] = {}
        self.peers = NodePeers()  #: the ranks that check this node's files together (the store sets them)

    # ------------------------------------------------------------ writing (background thread)

    def begin(self, step: int, expected_bytes: int) -> Optional[str]:
        """The directory this node's ranks write `step` into, or None when the tier is off or lacks room."""
        if self.off is not None:
            return None
        directory = os.path.join(self.root, step_dir_name(step))
        try:
            os.makedirs(directory, exist_ok=True)
            self._remove_steps(lambda other: other > step)  # left by saves that never committed (a rollback)
            # A step saved again: its old copy of the manifest goes first, so the directory is never "committed"
            # while its files are rewritten.
            _remove(os.path.join(directory, MANIFEST_NAME))
            usage = shutil.disk_usage(self.root)
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")
            return None
        reserve = max(RESERVE_BYTES, int(usage.total * RESERVE_SHARE))
        if usage.free < expected_bytes + reserve:
            self._remove_steps(lambda other: other < step)  # older than what storage is about to hold: no use
            if not self._told_no_room:
                logger.warning("checkpoint step %d is not kept in memory: %s has %d MiB free, the copy needs about "
                               "%d MiB and %d MiB stay free for DataLoader workers and NCCL (raise "
                               "resources.sharedMemory); told once", step, self.root, usage.free >> 20,
                               expected_bytes >> 20, reserve >> 20)
                self._told_no_room = True
            return None
        return directory

    def copy(self, directory: Optional[str], name: str) -> "TierCopy":
        return TierCopy(self, None if directory is None else os.path.join(directory, name))

    def rename(self, directory: Optional[str], old: str, new: str) -> None:
        if directory is None or self.off is not None:
            return
        try:
            os.replace(os.path.join(directory, old), os.path.join(directory, new))
        except FileNotFoundError:
            pass  # the copy was dropped
        except OSError as error:
            self.turn_off(f"{type(error).__name__}: {error}")

    def commit(self, step: int, manifest: bytes) -> None:
        """Storage committed `step`: mark this node's copy committed, then drop every other step."""
        if self.off is not None:
            self.discard(step)  # a copy that failed part way: free what it holds (/dev/shm may be full)
            return
        directory = os.path.join(self.root, step_dir_name(step))
        if not os.path.isdir(directory):
            return
        partial = os.path.join(directory, f".{MANIFEST_NAME}.{uuid.uuid4().hex}")  # ranks of a node race here
        try:
            with open(partial, "wb") as out:
                out.write(manifest)
            os.replace(partial, os.path.join(directory, MANIFEST_NAME))
        except OSError as error:
            _remove(partial)
            self.turn_off(f"{type(error).__name__}: {error}")
            return
        self._remove_steps(lambda other: other < step)

    def _remove_steps(self, which: Callable[[int], bool]) -> None:
        # Never the step a rank of this node may be writing: a slower rank still commits the step before.
        for name in os.listdir(self.root):
            match = _STEP_DIR.match(name)
            if match and which(int(match.group(1))):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def discard(self, step: int) -> None:
        """`step` was not committed: its copy goes."""
        shutil.rmtree(os.path.join(self.root, step_dir_name(step)), ignore_errors=True)

    def turn_off(self, why: str) -> None:
        if self.off is None:
            logger.warning("checkpoints are no longer kept in memory (%s): %s; restarts read them from storage",
                           self.root, why)
            self.off = why

    # ------------------------------------------------------------ restoring (training thread)

    def files(self, step: int, manifest_sha256: Optional[str]) -> dict[str, str]:
        """{file name: local path} of the checkpoint whose manifest has `manifest_sha256`, for the files this node
        holds that match the manifest's size and hash ({} when its copy of the manifest is another). Under
        torch.distributed a collective of the store's group (the node's ranks share the checking)."""
        if not manifest_sha256:
            return {}
        if manifest_sha256 not in self._verified:
            self._verified = {manifest_sha256: self._verify(step, manifest_sha256)}
        return self._verified[manifest_sha256][0]

    def forget(self) -> None:
        """Drop what was found checking the tier (it was written since)."""
        self._verified = {}

    def holds_all(self, step: int, manifest_sha256: Optional[str]) -> bool:
        """Whether every file of that checkpoint is here and verified (a collective, as `files`)."""
        found = self.files(step, manifest_sha256)
        return bool(found) and len(found) == self._verified[manifest_sha256][1]

    def _verify(self, step: int, manifest_sha256: str) -> tuple[dict[str, str], int]:
        directory = os.path.join(self.root, step_dir_name(step))
        listed: list = []
        try:
            with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
                raw = f.read()
            if hashlib.sha256(raw).hexdigest() == manifest_sha256:
                listed = json.loads(raw)["files"]
            else:
                logger.info("the checkpoint of step %d kept in memory is not the committed one: reading storage", step)
        except OSError:
            pass
        here = [entry for entry in listed if os.path.exists(os.path.join(directory, entry["path"]))]
        checked = {}
        for entry in self.peers.share_of(here):  # every rank of the node calls exchange, whatever it found
            path = os.path.join(directory, entry["path"])
            checked[entry["path"]] = _matches(path, entry)
            if not checked[entry["path"]]:
                logger.warning("%s does not match the manifest of step %d: reading it from storage", path, step)
        verified = {name: os.path.join(directory, name) for name, ok in self.peers.exchange(checked).items() if ok}
        return verified, len(listed)


class NodePeers:
    """The ranks that share this node's memory tier, splitting the checking of its files: each checks its share
    (by size), then they exchange what they found. Alone (no torch.distributed): all of it, nothing exchanged."""

    def __init__(self, ranks: tuple[int, ...] = (0,), rank: int = 0, exchange: Optional[Callable[[dict], dict]] = None):
        self.ranks = ranks  #: the node's ranks (in the store's group)
        self.index, self.count = ranks.index(rank), len(ranks)  #: this rank's place among them, and how many
        self._exchange = exchange

    def share_of(self, entries: list[dict]) -> list[dict]:
        """This rank's share of `entries` (manifest entries; every rank of the node has the same list)."""
        loads, shares = [0] * self.count, [[] for _ in range(self.count)]
        for entry in sorted(entries, key=lambda e: (-e["size"], e["path"])):
            lightest = loads.index(min(loads))
            loads[lightest] += entry["size"]
            shares[lightest].append(entry)
        return shares[self.index]

    def exchange(self, checked: dict[str, bool]) -> dict[str, bool]:
        """{file name: matched} as the node's ranks found it together."""
        return checked if self._exchange is None else self._exchange(checked)


class LocalFirstFileSystem:
    """Wraps DCP's reader FileSystem: the files in `local` ({name: path}) are read from the memory tier; `sources`
    says where the files read came from ("memory", "storage")."""

    def __init__(self, inner: Any, local: dict[str, str]):
        self._inner, self._local = inner, local
        self.sources: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        local = self._local.get(os.path.basename(os.fspath(path)))
        if local is None or mode != "rb":
            self.sources.add("storage")
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        self.sources.add("memory")
        with open(local, "rb") as stream:
            yield stream


class TierCopy:
    """One file being written to the tier beside its upload; a write error drops the copy, never the upload."""

    def __init__(self, tier: MemoryTier, path: Optional[str]):
        self.tier, self.path, self.file = tier, path, None
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

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
                os.replace(self.path + ".partial", self.path)
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
        self.tier.turn_off(f"{type(error).__name__}: {error}")


def _matches(path: str, entry: dict) -> bool:
    """Whether the file has the size and content of its manifest entry: by the xxh3_128 that the writer recorded
    beside the sha256 of every file it copied here (same bytes, 12x faster to check), else by the sha256."""
    fast = isinstance(entry.get("xxh3_128"), str)
    digest, expected = (xxhash.xxh3_128(), entry["xxh3_128"]) if fast else (hashlib.sha256(), entry["sha256"])
    try:
        if os.path.getsize(path) != entry["size"]:
            return False
        buffer = memoryview(bytearray(_HASH_CHUNK))
        with open(path, "rb", buffering=0) as f:
            while read := f.readinto(buffer):
                digest.update(buffer[:read])
    except OSError:
        return False
    return digest.hexdigest() == expected


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
