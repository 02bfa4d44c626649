"""`PeerCopies`: a pod whose memory lacks the newest checkpoint another pod holds gets its files from that pod's
memory, over the store's process group, before the restore reads them; storage is read only when no pod holds one.

A pod lost without SIGTERM (a node failure, a kernel panic) has no emergency save, and its replacement starts with an
empty /dev/shm. With several pods every pod's memory holds what a restore of each committed checkpoint reads there
(`mirroring`: every file, or for a sharded state on more than two pods its own ranks' files, its predecessor's, the
metadata and the replicated items), so a surviving pod holds everything the replacement's ranks read. Before a restore
every pod's lowest rank offers the newest checkpoint its memory holds (its step, the sha256 of its manifest, the files
it lists and those this pod holds: one `all_gather_object` of a few KiB a rank); each pod that lacks files of it its
ranks read (`layout.files_a_rank_reads`) receives them from a pod that lacks none and holds them (the pods that lack
them spread over the pods that can give them; for a sharded state on more than two pods that is the next pod, which
the ring gave them), over gloo point to point (`transfer.FileTransfer`):

1. the manifest, checked against the sha256 offered and parsed as storage's would be (plain file names, sizes);
2. a yes or no from the receiver (room for it in memory, a manifest that checks), so neither side waits on the other;
3. the files planned, in the manifest's order, each hashed as it arrives: a file is kept only when its digest is the
   manifest's, so a copy is the committed file byte for byte (a peer's damaged copy is dropped, with a warning, and
   that pod reads storage as if it had received nothing).

The receiver then marks the step committed in its memory tier, exactly as a pod that wrote it, and the restore goes on
as an in-place restart does: every pod loads from its own memory, the bytes received counted as from a `peer`. The
copy happens before storage is listed: a pod's newest is the newest committed but for a save no pod had room to keep,
where the restore then reads storage's newer one instead. When some pod lacks files no other pod can give (two
neighbours of a sharded state lost at once), no copy is made and the restore reads storage (rank 0 says so).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, TypeGuard

import torch

from .context import StoreContext
from .errors import describe_error
from .layout import FILE_DIGEST_HEX, MANIFEST_NAME, file_digest_name, files_a_rank_reads, is_plain_name, logger
from .listing import human_bytes
from .manifest import MAX_MANIFEST_BYTES, MAX_MANIFEST_FILES, parse_manifest
from .transfer import FileTransfer


@dataclass(frozen=True)
class Offer:
    """The newest checkpoint a pod's memory holds (all of its files or some): its step, its manifest's sha256 and size,
    the world size that saved it, every file it lists and those this pod holds."""

    step: int
    manifest_sha256: str
    manifest_bytes: int
    world_size: int
    listed: tuple[str, ...]
    held: tuple[str, ...]

    def same_checkpoint(self, other: "Offer") -> bool:
        return (self.step, self.manifest_sha256) == (other.step, other.manifest_sha256)


@dataclass(frozen=True)
class CopyPlan:
    """What `plan_copies` decided: the checkpoint to restore from memory (None: none offered), the copies to make
    ((from, to, files) by rank) and the pods (their lowest ranks) that lack files of it no other pod can give."""

    best: Optional[Offer]
    copies: list[tuple[int, int, tuple[str, ...]]]
    unserved: list[int]


def plan_copies(offers: list[Any], pods: list[list[int]], world_size: int) -> CopyPlan:
    """From every rank's offer (None but on each pod's lowest rank: the first of its ranks in `pods`): the checkpoint to
    restore from memory (the newest offered; for one step offered with two manifests, the lowest rank's) and the
    copies to make: each pod that lacks files its ranks read (`files_a_rank_reads`) receives them from one pod that
    lacks none and holds them all, the receivers spread over those. A sharded state on more than two pods has each
    pod's own files on the next pod only, so one lost pod is served by its successor; when some pod cannot be served
    (two neighbours lost) no copy is made: the restore reads storage."""
    leads = [ranks[0] for ranks in pods]
    offered = [(offers[lead], lead) for lead in leads if _plausible(offers[lead])]
    if not offered:
        return CopyPlan(None, [], [])
    best = max(offered, key=lambda found: (found[0].step, -found[1]))[0]
    same = {lead: set(offer.held) for offer, lead in offered if offer.same_checkpoint(best)}
    lacking = {}
    for ranks in pods:
        needed = set().union(*(files_a_rank_reads(best.listed, best.world_size, world_size, rank) for rank in ranks))
        missing = needed - same.get(ranks[0], set())
        if missing:
            lacking[ranks[0]] = missing
    sources = [lead for lead in same if lead not in lacking]
    copies, unserved = [], []
    for n, (target, missing) in enumerate(lacking.items()):
        able = [source for source in sources if missing <= same[source]]
        if not able:
            unserved.append(target)
            continue
        copies.append((able[n % len(able)], target, tuple(name for name in best.listed if name in missing)))
    return CopyPlan(best, [] if unserved else copies, unserved)


def _plausible(offer: object) -> TypeGuard[Offer]:
    """An offer as `PeerCopies._offer` makes them: a step, a sha256's 64 hex digits, a manifest size it may read, a
    world size, the plain file names a manifest may list, and held ones among them."""
    return (
        type(offer) is Offer
        and type(offer.step) is int
        and offer.step >= 0
        and type(offer.manifest_sha256) is str
        and FILE_DIGEST_HEX["sha256"].fullmatch(offer.manifest_sha256) is not None
        and type(offer.manifest_bytes) is int
        and 0 < offer.manifest_bytes <= MAX_MANIFEST_BYTES
        and type(offer.world_size) is int
        and offer.world_size > 0
        and type(offer.listed) is tuple
        and type(offer.held) is tuple
        and len(offer.listed) <= MAX_MANIFEST_FILES
        and all(is_plain_name(name) for name in offer.listed)
        and set(offer.held) <= set(offer.listed)
    )


class PeerCopies:
    """`share_newest` before a restore, on every rank. Active only with a memory tier on several nodes."""

    def __init__(self, context: StoreContext):
        self._context = context
        nodes = context.nodes
        self.active = context.tier is not None and len(set(nodes)) > 1
        #: Each pod's lowest rank: the one that offers, sends and receives for its pod.
        self.leads = [rank for rank, node in enumerate(nodes) if nodes.index(node) == rank]
        #: The ranks of each pod, its lowest first.
        self.pods = [[rank for rank, node in enumerate(nodes) if node == nodes[lead]] for lead in self.leads]

    def share_newest(self) -> Optional[int]:
        """Every rank: offer this pod's newest checkpoint in memory, then make the copies `plan_copies` asks for. The
        step this rank's pod received (whether or not its copy was kept, which the tier then shows), None when it
        received none. Collective errors are raised; a copy that fails is only left out."""
        if not self.active:
            return None
        ranks = self._context.ranks
        offers = ranks.gather(self._offer() if ranks.rank in self.leads else None)
        plan = plan_copies(offers, self.pods, ranks.world_size)
        if plan.best is None:
            return None
        if plan.unserved and ranks.rank == 0:
            logger.warning(
                "checkpoint step %d: no pod's memory holds all that the pods of rank %s read of it (lost with the "
                "pod that keeps their copies, or never kept for want of room): restoring from storage",
                plan.best.step,
                ", ".join(map(str, plan.unserved)),
            )
        nodes = self._context.nodes
        received = None
        for source, target, names in plan.copies:
            if ranks.rank == source:
                self._send(plan.best, target, names)
            elif ranks.rank == target:
                self._receive(plan.best, source, names)
            if nodes[target] == nodes[ranks.rank]:
                received = plan.best.step
        self._context.held_tier().forget()  # a rank of this pod may have written it
        return received

    def _offer(self) -> Optional[Offer]:
        tier = self._context.held_tier()
        step = tier.newest_step()
        origin = tier.origin_of_tier()
        if step is None or origin != tier.origin:
            return None
        try:
            with open(os.path.join(tier.path(step), MANIFEST_NAME), "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
            manifest = parse_manifest(raw)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        sha = hashlib.sha256(raw).hexdigest()
        held = tier.files(step, sha)
        if not held:
            return None
        listed = tuple(entry["path"] for entry in manifest["files"])
        saved_by = manifest.get("world_size") or self._context.ranks.world_size
        return Offer(step, sha, len(raw), saved_by, listed, tuple(name for name in listed if name in held))

    # ------------------------------------------------------------------ the two sides of a copy

    def _send(self, offer: Offer, target: int, names: tuple[str, ...]) -> None:
        tier = self._context.held_tier()
        directory = tier.path(offer.step)
        try:
            with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
                raw = f.read(offer.manifest_bytes)
        except OSError:
            raw = b""
        raw = raw.ljust(offer.manifest_bytes, b"\0")  # always what was offered: the receiver checks it
        transfer = self._transfer()
        transfer.put(torch.frombuffer(bytearray(raw), dtype=torch.uint8), target)
        if not transfer.get_flag(target):
            return
        files = [entry for entry in parse_manifest(raw)["files"] if entry["path"] in names]  # as the receiver does
        transfer.send_files([(os.path.join(directory, entry["path"]), entry["size"]) for entry in files], target)

    def _receive(self, offer: Offer, source: int, names: tuple[str, ...]) -> None:
        """The files `names` of the checkpoint `offer` from rank `source` into this pod's tier (beside those of it this
        pod holds), committed there when every file matched."""
        began = time.perf_counter()
        tier = self._context.held_tier()
        transfer = self._transfer()
        raw = torch.empty(offer.manifest_bytes, dtype=torch.uint8)
        transfer.get(raw, source)
        manifest_bytes = raw.numpy().tobytes()
        why: Optional[str] = None
        files: list = []
        listed = 0
        digest_name = ""
        directory: Optional[str] = None
        if hashlib.sha256(manifest_bytes).hexdigest() != offer.manifest_sha256:
            why = "its manifest is not the one it offered"
        else:
            try:
                manifest = parse_manifest(manifest_bytes)
                listed, digest_name = len(manifest["files"]), file_digest_name(manifest["format_version"])
                files = [entry for entry in manifest["files"] if entry["path"] in names]
            except (ValueError, KeyError, TypeError) as exc:
                why = f"its manifest is not valid: {describe_error(exc)}"
        if why is None:
            directory = tier.begin(offer.step, sum(entry["size"] for entry in files))
            if directory is None:
                why = tier.off or "this pod's memory has no room for it"
        transfer.put_flag(why is None, source)
        if why is not None or directory is None:
            logger.warning(
                "checkpoint step %d: not copied from rank %d's memory (%s): reading storage", offer.step, source, why
            )
            return
        bad = transfer.receive_files(directory, files, digest_name, source)
        if bad:
            tier.discard(offer.step)
            logger.warning(
                "checkpoint step %d: %d files copied from rank %d's memory do not match the manifest (%s): its copy "
                "is damaged, reading storage",
                offer.step,
                len(bad),
                source,
                ", ".join(bad[:3]),
            )
            return
        tier.commit(offer.step, manifest_bytes)
        total = sum(entry["size"] for entry in files)
        logger.info(
            "checkpoint step %d: copied %s from rank %d's memory in %.2f s (this pod's memory lacked %s)",
            offer.step,
            human_bytes(total),
            source,
            time.perf_counter() - began,
            "it" if len(files) == listed else f"{len(files)} of its {listed} files, which its ranks read",
        )

    def _transfer(self) -> FileTransfer:
        return FileTransfer(self._context.ranks.group, self._context.held_tier())
