"""`PeerCopies`: a pod whose memory lacks the newest checkpoint another pod holds gets its files from that pod's
memory, over the store's process group, before the restore reads them; storage is read only when no pod holds one.

A pod lost without SIGTERM (a node failure, a kernel panic) has no emergency save, and its replacement starts with an
empty /dev/shm; with several pods every pod's memory holds every file of each committed checkpoint (`mirroring`), so a
surviving pod holds everything the replacement needs. Before a restore every pod's lowest rank offers the newest
checkpoint its memory holds whole (its step and the sha256 of its manifest, one `all_gather_object` of a few bytes a
rank); each pod without that very checkpoint receives it from a pod that has it (the pods that lack it spread over the
pods that hold it), over gloo point to point (`transfer.FileTransfer`):

1. the manifest, checked against the sha256 offered and parsed as storage's would be (plain file names, sizes);
2. a yes or no from the receiver (room for it in memory, a manifest that checks), so neither side waits on the other;
3. every file the manifest lists, in its order, each hashed as it arrives: a file is kept only when its digest is the
   manifest's, so a copy is the committed file byte for byte (a peer's damaged copy is dropped, with a warning, and
   that pod reads storage as if it had received nothing).

The receiver then marks the step committed in its memory tier, exactly as a pod that wrote it, and the restore goes on
as an in-place restart does: every pod loads from its own memory, the bytes received counted as from a `peer`. The
copy happens before storage is listed: a pod's newest is the newest committed but for a save no pod had room to keep,
where the restore then reads storage's newer one instead. A sharded (FSDP2) state on two pods is offered as any other
(each pod holds both pods' files, `mirroring`); on more pods none is: no pod holds every file of it.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, TypeGuard

import torch

from .context import StoreContext
from .layout import FILE_DIGEST_HEX, MANIFEST_NAME, _describe, file_digest_name, logger
from .listing import human_bytes
from .manifest import MAX_MANIFEST_BYTES, _parse_manifest
from .transfer import FileTransfer


@dataclass(frozen=True)
class Offer:
    """The newest checkpoint a pod's memory holds whole: its step, and its manifest's sha256 and size."""

    step: int
    manifest_sha256: str
    manifest_bytes: int


def plan_copies(offers: list[Any], leads: list[int]) -> tuple[Optional[Offer], list[tuple[int, int]]]:
    """From every rank's offer (None but on each pod's lowest rank, `leads`): the checkpoint to restore from memory (the
    newest offered; for one step offered with two manifests, the lowest rank's) and the copies to make, (from, to) by
    rank: each pod that does not hold it receives it from one that does, the receivers spread over the holders."""
    offered = [(offer, rank) for rank, offer in enumerate(offers) if rank in leads and _plausible(offer)]
    if not offered:
        return None, []
    best = max(offered, key=lambda found: (found[0].step, -found[1]))[0]
    holders = [rank for rank in leads if offers[rank] == best]
    lacking = [rank for rank in leads if offers[rank] != best]
    return best, [(holders[i % len(holders)], rank) for i, rank in enumerate(lacking)]


def _plausible(offer: object) -> TypeGuard[Offer]:
    """An offer as `PeerCopies._offer` makes them: a step, a sha256's 64 hex digits, a manifest size it may read."""
    return (
        type(offer) is Offer
        and type(offer.step) is int
        and offer.step >= 0
        and type(offer.manifest_sha256) is str
        and FILE_DIGEST_HEX["sha256"].fullmatch(offer.manifest_sha256) is not None
        and type(offer.manifest_bytes) is int
        and 0 < offer.manifest_bytes <= MAX_MANIFEST_BYTES
    )


class PeerCopies:
    """`share_newest` before a restore, on every rank. Active only with a memory tier on several nodes."""

    def __init__(self, context: StoreContext):
        self._context = context
        nodes = context.nodes
        self.active = context.tier is not None and len(set(nodes)) > 1
        #: Each pod's lowest rank: the one that offers, sends and receives for its pod.
        self.leads = [rank for rank, node in enumerate(nodes) if nodes.index(node) == rank]

    def share_newest(self) -> Optional[int]:
        """Every rank: offer this pod's newest checkpoint in memory, then make the copies `plan_copies` asks for. The
        step this rank's pod received (whether or not its copy was kept, which the tier then shows), None when it
        received none. Collective errors are raised; a copy that fails is only left out."""
        if not self.active:
            return None
        ranks = self._context.ranks
        offers = ranks.gather(self._offer() if ranks.rank in self.leads else None)
        best, copies = plan_copies(offers, self.leads)
        if best is None:
            return None
        nodes = self._context.nodes
        received = None
        for source, target in copies:
            if ranks.rank == source:
                self._send(best, target)
            elif ranks.rank == target:
                self._receive(best, source)
            if nodes[target] == nodes[ranks.rank]:
                received = best.step
        self._context.held_tier().forget()  # a rank of this pod may have written it
        return received

    def _offer(self) -> Optional[Offer]:
        tier = self._context.held_tier()
        step = tier.newest_step()
        origin = tier.origin_of_tier()
        if step is None or (origin is not None and origin != self._context.uri):
            return None
        try:
            with open(os.path.join(tier.path(step), MANIFEST_NAME), "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError:
            return None
        sha = hashlib.sha256(raw).hexdigest()
        return Offer(step, sha, len(raw)) if tier.holds_all(step, sha) else None

    # ------------------------------------------------------------------ the two sides of a copy

    def _send(self, offer: Offer, target: int) -> None:
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
        files = _parse_manifest(raw)["files"]  # the receiver parsed these very bytes
        transfer.send_files([(os.path.join(directory, entry["path"]), entry["size"]) for entry in files], target)

    def _receive(self, offer: Offer, source: int) -> None:
        """The checkpoint `offer` from rank `source` into this pod's tier, committed there when every file matched."""
        began = time.perf_counter()
        tier = self._context.held_tier()
        transfer = self._transfer()
        raw = torch.empty(offer.manifest_bytes, dtype=torch.uint8)
        transfer.get(raw, source)
        manifest_bytes = raw.numpy().tobytes()
        why: Optional[str] = None
        files: list = []
        digest_name = ""
        directory: Optional[str] = None
        if hashlib.sha256(manifest_bytes).hexdigest() != offer.manifest_sha256:
            why = "its manifest is not the one it offered"
        else:
            try:
                manifest = _parse_manifest(manifest_bytes)
                files, digest_name = manifest["files"], file_digest_name(manifest["format_version"])
            except (ValueError, KeyError, TypeError) as exc:
                why = f"its manifest is not valid: {_describe(exc)}"
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
            "checkpoint step %d: copied %s from rank %d's memory in %.2f s (this pod's memory lacked it)",
            offer.step,
            human_bytes(total),
            source,
            time.perf_counter() - began,
        )

    def _transfer(self) -> FileTransfer:
        return FileTransfer(self._context.ranks.group, self._context.held_tier())
