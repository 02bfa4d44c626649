"""`NodeMirror`: with several pods, each pod's memory tier also holds the data files the other pods' ranks wrote, so a
restart inside any pod reads no byte of the checkpoint from storage, and a lost pod's replacement receives them from
a survivor (`peers`).

DCP writes each replicated tensor (a DDP model, its optimizer state) from one rank and spreads them over every rank's
file, so a pod's memory held only its own ranks' files and a restart read the rest from storage. But every pod
already holds every replicated tensor: the lowest rank of each pod writes each file of another pod's rank again,
into its own node's tier, from its own staged copy (no network for the tensors). Only the items it does not hold
come over the run's process group: each file's byte items (the optimizer's plain values, the writing rank's extra
state: a few KiB) and rank 0's `.metadata`. A file is kept only when its xxh3_128 is the one its writer recorded for
the manifest, so the copy is the committed file byte for byte, and a restart checks it as it reads as any other
tier file; a copy that differs (a replica that is not bitwise equal) or that finds no room is left out, with a
warning, and a restart reads that file from storage.

A sharded state (FSDP2's DTensors) has no replica to write from: each pod's lead sends the files its own ranks wrote
to the next pod's lead, in a ring (`transfer.FileTransfer`, the same digests decide what is kept), and receives the
previous pod's. With two pods that is every file on every pod, as with DDP; with more, each pod holds its own ranks'
files and its neighbour's, no pod holds them all, and each pod's lead copies its own ranks' files to storage
(`persisting`, spread over the pods). Either way checkpoints commit in memory. Each rank of such a run also reads items that every rank holds alike (the optimizer's step counts
and settings), which DCP spreads over every rank's file: rank 0 writes them all, into a small file of their own that
every pod keeps (`keeps_replicated_apart`), so a restart in place reads only its own pod's memory (`restoring`).

One collective a save (every rank's items gathered), after the write, on the checkpoint thread; for a sharded state
also the ring's two transfers a pod.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
import xxhash

from ..torch_internals import flatten_state_dict
from .context import StoreContext
from .errors import describe_error
from .layout import FILE_DIGEST, METADATA_NAME, REPLICATED_SUFFIX, logger
from .memory_tier import reserve_bytes
from .tensor_files import byte_view
from .tier_files import SEGMENTS_KEY, RecycledFile, SegmentHasher, remove_file
from .tier_staging import ALIGN, StagedFile, plain_tensors, staged_at, staging_layout, tensors_of
from .transfer import FileTransfer

#: The largest file of replicated items every pod keeps (`NodeMirror.keeps_replicated_apart`; sent to every rank with
#: the gathered file lists): a larger one (a state that is mostly not sharded) goes round the ring as the others do.
MAX_REPLICATED_BYTES = 16 << 20


@dataclass(frozen=True)
class _Item:
    """One item of a rank's data file: where it lies, and its bytes when the other pods cannot hold it."""

    fqn: str
    offset: int
    length: int
    data: Optional[bytes]  #: a byte item's bytes; None for a tensor, which every pod holds


@dataclass(frozen=True)
class _WrittenFile:
    """A data file a rank wrote, as the other pods' mirrors need it."""

    node: str
    name: str
    size: int
    digest: str
    items: tuple[_Item, ...]
    whole: Optional[bytes] = None  #: the file itself (rank 0's `.metadata`)


class NodeMirror:
    """Gathers where every rank's items lie, then has the lowest rank of each pod write the other pods' files into its
    node's memory tier (`exchange`). Active only with a memory tier on several nodes."""

    def __init__(self, context: StoreContext):
        self._context = context
        nodes = context.nodes
        self.active = context.tier is not None and len(set(nodes)) > 1
        rank = context.ranks.rank
        #: Each pod's lowest rank, in rank order: the one that writes its pod's copies (and sends in the ring).
        self.leads = [lead for lead, node in enumerate(nodes) if nodes.index(node) == lead]
        #: Whether this rank writes its pod's copies.
        self.writes = self.active and rank in self.leads
        #: Whether the state is sharded (FSDP2's DTensors), from the first save (`check_state`); None before.
        self.sharded: Optional[bool] = None
        self._told: set[str] = set()
        #: Whether this pod's memory had no room for the other pods' files at the last exchange.
        self.short_of_room = False
        #: The lead: the items of each other pod's data file at the last exchange, by file name (`stage_copies`).
        self._layouts: dict[str, tuple[_Item, ...]] = {}
        #: The lead: this save's copies of the other pods' files, their tensors staged (`stage_copies`), each with
        #: the items it was staged by.
        self._staged: dict[str, tuple[StagedFile, tuple[_Item, ...]]] = {}
        #: The lead: copies kept that were staged where their ranks stage them (for the figures and tests).
        self.staged_copies_kept = 0

    def check_state(self, state: Any) -> None:
        """Every rank, before each save of `state`: at the first, whether it is sharded (FSDP2's DTensors: copies
        come from the pod that wrote them, in a ring). On more than two pods a ring leaves no pod holding every file:
        each pod keeps its own ranks' files, its neighbour's and the replicated items, and persisting behind is spread
        over the pods (`persisting`, said once)."""
        if not self.active or self.sharded is not None:
            return
        self.sharded = any(hasattr(tensor, "placements") for tensor in tensors_of(state))
        if self.keeps_replicated_apart and self._context.persist_behind:
            logger.info(
                "a sharded state on %d pods: each pod keeps its own ranks' files, its neighbour's and the replicated "
                "items in memory, checkpoints commit there, and each pod copies its own ranks' files to storage",
                len(self.leads),
            )

    @property
    def keeps_replicated_apart(self) -> bool:
        """Whether this store's saves put the items every rank holds alike into a file of rank 0's that every pod
        keeps: a sharded state on more than two pods, where a pod holds only its own ranks' files and its
        neighbour's, and each rank reads them besides its own shards (DCP spreads them over every rank's file)."""
        return self.active and bool(self.sharded) and len(self.leads) > 2

    @property
    def rebuilds(self) -> bool:
        """Whether this save's copies are rebuilt from each pod's own replica, which needs the whole state staged
        (not a sharded state's: its files come over the network)."""
        return self.active and not self.sharded

    def can_stage_copies(self, state: Any) -> bool:
        """The lead, before a save by the last plan of `state` (CPU tensors): whether it may stage the other pods'
        files straight into its copies of them (`stage_copies`): at the last exchange each of them lay as their
        ranks' `StagedFile` lays out the tensors `state` holds (not so after a save DCP's writer wrote whole, the
        first of a plan), the byte items after them."""
        if not (self.writes and self.rebuilds and self._layouts and plain_tensors(state, "cpu")):
            return False
        flat = flatten_state_dict(state)[0]
        for items in self._layouts.values():
            if not all(isinstance(flat.get(item.fqn), torch.Tensor) for item in items if item.data is None):
                return False
            tensors = [(item, flat[item.fqn]) for item in items if item.data is None]
            offsets, end, _ = staging_layout(state, [tensor for _, tensor in tensors])
            if any(staged_at(tensor, offsets) != item.offset for item, tensor in tensors):
                return False
            at = end
            for item in sorted((item for item in items if item.data is not None), key=lambda item: item.offset):
                if item.offset != at:
                    return False
                at += item.length
        return True

    def stage_copies(self, state: Any, tier_dir: str) -> None:
        """The lead, on a save by the last plan, when `can_stage_copies`: stage each other pod's data file into this
        pod's copy of it, from this rank's replica, as that file's rank stages it (the tensors its plan writes, where
        its `StagedFile` puts them, the padding zeroed), so the exchange only appends the byte items it receives and
        hashes (stage once on several pods too: the copy costs no second pass over the state). Raises OSError (no
        room)."""
        flat = flatten_state_dict(state)[0]
        for name, items in self._layouts.items():
            staged = StagedFile(os.path.join(tier_dir, name))
            self._staged[name] = (staged, items)
            staged.stage(state, [flat[item.fqn] for item in items if item.data is None])

    def drop_staged(self) -> None:
        """The save is over: let go of its staged copies."""
        for staged, _ in self._staged.values():
            staged.close()
        self._staged = {}

    def exchange(
        self, step: int, state: Any, record: dict, results: list, tier_dir: Optional[str]
    ) -> tuple[bool, bool]:
        """Every rank, after writing `step` (its files' manifest entries in `record`, its write `results`; `tier_dir`:
        this node's copy, None when it keeps none or this rank could not write): gather every rank's files, and on the
        lowest rank of each node write the other nodes' files into `tier_dir` from `state`, this rank's staged copy.
        Whether every node now holds every file, and whether every rank had a `tier_dir` (one more collective: every
        rank gets the same answers). Collective errors are raised (the save fails with them); anything else only
        leaves a copy out."""
        if not self.active:
            return True, True
        self.short_of_room = False
        sent = self._files_of(record, results, tier_dir)
        gathered = self._context.ranks.gather(sent)
        kept = self._write_wanted(step, state, gathered, tier_dir) if self.writes else True
        every_node_holds_all, every_rank_wrote = self._context.ranks.all(
            kept and sent is not None, tier_dir is not None
        )
        return every_node_holds_all, every_rank_wrote

    def write_metadata(self, step: int, metadata: bytes, manifest: bytes, tier_dir: str) -> bool:
        """The lowest rank of a node but rank 0's, once `step` committed: rank 0's `.metadata`, which a save by the
        last plan writes after the exchange (`committing`), kept when it is the manifest's. Whether it was."""
        try:
            listed = {entry["path"]: entry for entry in json.loads(manifest)["files"]}
            entry = listed[METADATA_NAME]
        except (ValueError, KeyError, TypeError):
            return False
        node = self._context.nodes[self._context.ranks.rank]
        whole = _WrittenFile(node, METADATA_NAME, entry["size"], entry[FILE_DIGEST], (), metadata)
        return self._write(step, whole, {}, tier_dir)

    def _write_wanted(self, step: int, state: Any, gathered: list, tier_dir: Optional[str]) -> bool:
        """This node's copies of the other nodes' files (a sharded state's: its neighbour's, in the ring); whether it
        holds them all now. Every lead sees the same `gathered`, so either every lead takes part in the ring or none."""
        if tier_dir is None or any(files is None for files in gathered):
            return False
        nodes = self._context.nodes
        node = nodes[self._context.ranks.rank]
        _, before = self._neighbours()
        wanted = [
            f
            for files in gathered
            for f in files
            if f.node != node and (not self.sharded or f.whole is not None or f.node == nodes[before])
        ]
        room = self._room_for(step, [f for f in wanted if f.name not in self._staged])  # staged ones hold theirs
        kept = self._ring(gathered, tier_dir, room) if self.sharded else True
        if not room:
            return False
        if self.rebuilds:
            self._layouts = {f.name: f.items for f in wanted if f.whole is None}
        tensors = {fqn: value for fqn, value in flatten_state_dict(state)[0].items() if isinstance(value, torch.Tensor)}
        rebuilt = [f for f in wanted if not self.sharded or f.whole is not None]
        return all([self._copy(step, written, tensors, tier_dir) for written in rebuilt]) and kept

    def _copy(self, step: int, written: _WrittenFile, tensors: dict, tier_dir: str) -> bool:
        """This pod's copy of `written`: its staged copy completed (`stage_copies`), else written from `tensors`."""
        if written.name not in self._staged:
            return self._write(step, written, tensors, tier_dir)
        why = self._complete_staged(written, tier_dir)
        if why is None:
            self.staged_copies_kept += 1
            return True
        self._left_out(step, written.name, os.path.join(tier_dir, written.name), why)
        return False

    def _complete_staged(self, written: _WrittenFile, tier_dir: str) -> Optional[str]:
        """This pod's staged copy of `written` (`stage_copies`), completed with the byte items it was sent: None when
        it is now that file byte for byte (its digests file written), else why not."""
        staged, staged_by = self._staged.pop(written.name)
        try:
            tensors_at = [(item.fqn, item.offset, item.length) for item in written.items if item.data is None]
            if tensors_at != [(item.fqn, item.offset, item.length) for item in staged_by if item.data is None]:
                return "its tensors lie elsewhere than at the last save"
            entry = staged.complete_copy([(item.offset, item.data) for item in written.items if item.data is not None])
            if entry["size"] != written.size or entry[FILE_DIGEST] != written.digest:
                return "its bytes differ from the file the other pod wrote (a replica that is not bitwise equal?)"
            self._context.held_tier().write_digests(
                tier_dir, written.name, written.size, FILE_DIGEST, written.digest, entry[SEGMENTS_KEY]
            )
            return None
        except (OSError, ValueError) as exc:
            return describe_error(exc)
        finally:
            staged.close()

    def _room_for(self, step: int, wanted: list[_WrittenFile]) -> bool:
        """Whether this pod's memory has room for `wanted` beside its reserve (said once when not)."""
        if not wanted:
            return True
        usage = shutil.disk_usage(self._context.held_tier().root)
        needed = sum(f.size for f in wanted)
        if usage.free >= needed + reserve_bytes(usage.total):
            return True
        self.short_of_room = True
        self._tell(
            "room",
            f"checkpoint step {step}: this pod's memory has {usage.free >> 20} MiB free, not enough for the "
            f"{needed >> 20} MiB the other pods' ranks wrote: a restart here reads them from storage (raise "
            "resources.sharedMemory)",
        )
        return False

    def _ring(self, gathered: list, tier_dir: str, room: bool) -> bool:
        """A sharded state's lead: send this pod's ranks' data files to the next pod's lead and receive the previous
        pod's (when `room`) into `tier_dir`, both at once (the send on a thread of its own: on two pods the two
        directions overlap, 0.26 s instead of 0.41-0.85 s one after the other for 129 MiB each way on the 2-core VM);
        whether every file received was kept. Each receiver first says whether it takes them, so a sender never sends
        into a pod without room."""
        rank, nodes = self._context.ranks.rank, self._context.nodes
        after, before = self._neighbours()
        transfer = FileTransfer(self._context.ranks.group, self._context.held_tier())
        mine = [f for files in gathered for f in files if f.node == nodes[rank] and f.whole is None]
        theirs = [f for files in gathered for f in files if f.node == nodes[before] and f.whole is None]
        kept = True

        def send() -> None:
            if transfer.get_flag(after):
                transfer.send_files([(os.path.join(tier_dir, f.name), f.size) for f in mine], after)

        def receive() -> None:
            nonlocal kept
            transfer.put_flag(room, before)
            if not room:
                return
            entries = [{"path": f.name, "size": f.size, FILE_DIGEST: f.digest} for f in theirs]
            for name in transfer.receive_files(tier_dir, entries, FILE_DIGEST, before):
                kept = False
                self._tell(
                    name,
                    f"this pod keeps no copy of {name} in memory (the copy rank {before}'s pod sent does not match "
                    "the file its rank wrote): a restart here reads it from storage",
                )

        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-ring") as pool:
            sending = pool.submit(send)
            receive()
            sending.result()
        return kept

    def _neighbours(self) -> tuple[int, int]:
        """A lead's next and previous pod's leads in the ring (rank order, wrapping round)."""
        at = self.leads.index(self._context.ranks.rank)
        return self.leads[(at + 1) % len(self.leads)], self.leads[(at - 1) % len(self.leads)]

    def _files_of(self, record: dict, results: list, tier_dir: Optional[str]) -> Optional[list[_WrittenFile]]:
        """What this rank wrote, for the other pods: None when its node keeps no copy to read byte items from."""
        if tier_dir is None:
            return None
        node = self._context.nodes[self._context.ranks.rank]
        by_file: dict[str, list] = {}
        for result in results:
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        files = []
        try:
            for name, entry in record.items():
                path = os.path.join(tier_dir, name)
                if name == METADATA_NAME or (
                    self.sharded and name.endswith(REPLICATED_SUFFIX) and entry["size"] <= MAX_REPLICATED_BYTES
                ):  # every pod keeps it (`keeps_replicated_apart`)
                    with open(path, "rb") as f:
                        whole = f.read(entry["size"] + 1)
                    files.append(_WrittenFile(node, name, entry["size"], entry[FILE_DIGEST], (), whole))
                    continue
                items: list[_Item] = []
                if self.sharded:  # sent whole, from this file (`_ring`)
                    files.append(_WrittenFile(node, name, entry["size"], entry[FILE_DIGEST], ()))
                    continue
                with open(path, "rb") as f:
                    for result in sorted(by_file.get(name, []), key=lambda r: r.storage_data.offset):
                        info = result.storage_data
                        data = None
                        if not info.transform_descriptors:  # a byte item (tensors are raw, `tensor_files`)
                            f.seek(info.offset)
                            data = f.read(info.length)
                        items.append(_Item(result.index.fqn, info.offset, info.length, data))
                files.append(_WrittenFile(node, name, entry["size"], entry[FILE_DIGEST], tuple(items)))
        except OSError as exc:  # this node's copy of its own file is gone: the others read it from storage
            logger.warning("checkpoint: rank %d cannot read its copy in memory (%s)", self._context.ranks.rank, exc)
            return None
        return files

    def _write(self, step: int, written: _WrittenFile, tensors: dict, tier_dir: str) -> bool:
        """One file of another pod's rank into `tier_dir`, into the pages of the spare's file of its name when there
        is one (`RecycledFile`, as this pod's own files are written: a new /dev/shm file costs a page fault per 4
        KiB), hashed as it is written; its digests file last, so a copy cut short is never used."""
        path = os.path.join(tier_dir, written.name)
        digest, segments = xxhash.xxh3_128(), SegmentHasher()
        why: Optional[str] = None
        try:
            chunks = [written.whole] if written.whole is not None else self._chunks(written, tensors)
            done = 0
            with RecycledFile(path) as out:
                for chunk in chunks:
                    if isinstance(chunk, str):
                        why = chunk
                        break
                    out.write(chunk)
                    digest.update(chunk)
                    segments.update(chunk)
                    done += memoryview(chunk).nbytes
            if why is None and done != written.size:
                why = f"{done} bytes, not {written.size}"
            if why is None and digest.hexdigest() != written.digest:
                why = "its bytes differ from the file the other pod wrote (a replica that is not bitwise equal?)"
            if why is None:
                self._context.held_tier().write_digests(
                    tier_dir, written.name, written.size, FILE_DIGEST, written.digest, segments.finish()
                )
                return True
        except Exception as exc:  # never fail a save for a copy
            why = describe_error(exc)
        self._left_out(step, written.name, path, why)
        return False

    def _left_out(self, step: int, name: str, path: str, why: Optional[str]) -> None:
        remove_file(path)
        self._tell(
            name,
            f"checkpoint step {step}: this pod keeps no copy of {name} in memory ({why}): a restart here reads it "
            "from storage",
        )

    @staticmethod
    def _chunks(written: _WrittenFile, tensors: dict) -> Any:
        """The file's bytes, item by item in file order, from this rank's tensors and the byte items sent (zeros
        between them where a staged file aligns them); a str (why not) where it cannot be built."""
        at = 0
        for item in written.items:
            if at < item.offset < at + ALIGN:  # a staged file's alignment padding, which it zeroes
                yield bytes(item.offset - at)
                at = item.offset
            if item.offset != at:
                yield f"a gap at byte {at}"
                return
            if item.data is not None:
                yield item.data
            else:
                tensor = tensors.get(item.fqn)
                if tensor is None or tensor.device.type != "cpu":
                    yield f"this pod holds no {item.fqn}"
                    return
                view = byte_view(tensor.contiguous())
                if view.nbytes != item.length:
                    yield f"{item.fqn} has {view.nbytes} bytes here, {item.length} there"
                    return
                yield view
            at += item.length

    def _tell(self, key: str, message: str) -> None:
        """Warn once per kind of trouble, as the tier tells of its room."""
        if key not in self._told:
            self._told.add(key)
            logger.warning("%s; told once", message)
