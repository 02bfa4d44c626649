"""`PodHooks`: what a save does because the run has several pods, at the three points of the commit where it acts
(`committing.Committer`): before staging, after writing, after the commit. On one pod every hook does nothing and
every answer is the one-pod one, so a reader of the commit can skip this module until the run has several pods.

Two things happen there. Each pod's memory also keeps the other pods' files (`mirroring.NodeMirror`: rebuilt from the
pod's own replica, or a sharded state's received in a ring), so a save commits in memory only once every pod holds
what a restart there reads. Where no pod holds every file (a sharded state on more than two pods), persisting behind
is spread over the pods (`persisting.Persister.spread_over_pods`): rank 0 plans which checkpoint the pods copy at each
commit in memory, the commit's broadcast tells every pod's lead, and each copies its own pod's part."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from .context import StoreContext
from .errors import describe_error
from .layout import METADATA_NAME, logger
from .manifest import MAX_MANIFEST_BYTES
from .mirroring import NodeMirror
from .persisting import Persister
from .records import CommitOutcome, RankPart


@dataclass(frozen=True)
class Staging:
    """How a save stages what it left to the checkpoint thread (`Committer._stage_later`), as the pods need it."""

    #: Stage into this rank's data file in the memory tier (stage once, `tier_staging`); False: the whole state by
    #: the stager, because this pod's lead rebuilds the other pods' files from it.
    once: bool = True
    #: The lead also stages the other pods' files straight into its copies of them (`NodeMirror.stage_copies`).
    copies: bool = False
    #: Every tensor goes beside this rank's file (the lead rebuilds the other pods' files from them), not only what
    #: rank 0's model digest reads.
    whole: bool = False


class PodHooks:
    """The several-pods part of every save; each hook is called on every rank, in the commit's order."""

    def __init__(self, context: StoreContext, persister: Persister):
        self._context = context
        self._persister = persister
        #: Each pod's copy of the other pods' files.
        self.mirror = NodeMirror(context)

    @property
    def keeps_replicated_apart(self) -> bool:
        """Rank 0 writes the items every rank holds alike into a file of its own that every pod keeps
        (`NodeMirror.keeps_replicated_apart`): the planner and the writer put them there."""
        return self.mirror.keeps_replicated_apart

    @property
    def short_of_room(self) -> bool:
        """This pod's memory had no room for the other pods' files at the last save (status names such pods)."""
        return self.mirror.short_of_room

    # Before staging.

    def before_staging(self, state: dict) -> None:
        """At the first save of `state`: whether it is sharded; where that leaves no pod holding every file, persisting
        behind is spread over the pods from now on."""
        self.mirror.check_state(state)
        if self.mirror.keeps_replicated_apart and self._context.persist_behind and not self._persister.spread:
            self._persister.spread_over_pods(self.mirror.leads)

    def staging(self, by_last_plan: bool, in_memory: bool, later: dict) -> Staging:
        """How this rank stages `later` (what the save left to the checkpoint thread). `by_last_plan`: every rank
        writes by its last plan, into the memory tier. A pod's lead that rebuilds the other pods' files needs the
        whole state staged, unless it writes by the last plan: then it stages their files straight into its copies
        once it knows they lie so (`can_stage_copies`), else keeps every tensor beside its own file."""
        if not self.mirror.rebuilds:
            return Staging()
        copies = by_last_plan and in_memory and self.mirror.can_stage_copies(later)
        return Staging(once=by_last_plan, copies=copies, whole=by_last_plan and self.mirror.writes and not copies)

    def stage_copies(self, step: int, later: dict, tier_dir: str) -> None:
        """The lead, `Staging.copies`: stage the other pods' files into its copies of them. No room is said and left
        to the exchange, which finds them missing, says so, and has the save commit to storage."""
        try:
            self.mirror.stage_copies(later, tier_dir)
        except OSError as exc:
            logger.warning(
                "checkpoint step %d: rank %d cannot stage the other pods' files in %s (%s)",
                step,
                self._context.ranks.rank,
                tier_dir,
                describe_error(exc),
            )
            self.mirror.drop_staged()

    # After writing.

    def after_writing(
        self, step: int, state: Any, record: dict, results: list, tier_dir: Optional[str], in_memory: bool
    ) -> Optional[str]:
        """Every rank, after writing `step` from `state` (its files' entries in `record`, its write `results`;
        `tier_dir`: this node's copy, None when it keeps none or failed): the pods' leads copy the other pods' files.
        Why the save cannot commit in memory, or None. A collective's error (a peer gone) is raised."""
        if not self.mirror.active:
            return None
        every_pod_holds_all, every_rank_wrote = self.mirror.exchange(step, state, record, results, tier_dir)
        if not in_memory or every_pod_holds_all or not every_rank_wrote:
            return None  # a rank that could not write fails this save alone: the commit's gather says why
        # Every rank has the same answers (the exchange's last collective), so every rank stops alike.
        return self._stop_persisting_behind(step)

    def _stop_persisting_behind(self, step: int) -> str:
        """Every rank, when a pod could not keep every file of `step` in its memory (no room, a replica that is not
        bitwise equal) though every rank wrote its part: this save fails, and the saves from now on commit to
        storage (each pod's copies kept where they can be). Storage first gets what memory committed before
        (`Persister.persist_newest`). The error."""
        self._persister.persist_newest()
        self._context.persist_behind = False
        logger.warning(
            "checkpoint step %d: not every pod could keep every file of it in memory (see the warnings above): "
            "checkpoints commit to storage from now on",
            step,
        )
        return "a pod could not keep every file of the checkpoint in memory"

    # The commit.

    @property
    def part_done(self) -> Optional[tuple[int, bool]]:
        """This pod's lead, persisting spread over the pods: the step whose part it last copied, and whether that
        copy succeeded; rank 0 gathers it with the commit's parts (`RankPart.part_done`)."""
        return self._persister.part_done

    def at_commit(self, outcome: CommitOutcome, parts: list[RankPart], planned_dir: Optional[str]) -> None:
        """Rank 0, once `outcome` committed in memory, before its broadcast: the metadata it wrote by the last plan
        into `planned_dir` (after the exchange), for the other pods' copies; and, spread over the pods, the
        checkpoint every pod's lead is now to copy its part of."""
        if outcome.info is None:
            return
        outcome.metadata = self._metadata_for_mirrors(planned_dir)
        if self._persister.spread:
            outcome.copy_part = self._persister.plan_parts(
                outcome.info, outcome.manifest, [part.part_done for part in parts]
            )

    def _metadata_for_mirrors(self, planned_dir: Optional[str]) -> Optional[bytes]:
        """The metadata rank 0 wrote into `planned_dir`, for the other pods' leads; None without one, on one pod, or
        when unreadable (those pods then lack it, and a restart there receives it from this pod, `peers`)."""
        if planned_dir is None or not self.mirror.active:
            return None
        try:
            with open(os.path.join(planned_dir, METADATA_NAME), "rb") as f:
                return f.read(MAX_MANIFEST_BYTES)
        except OSError:
            return None

    # After the commit.

    def after_commit(self, step: int, outcome: CommitOutcome, tier_dir: str) -> None:
        """Every rank, once `step` committed in memory (rank 0 committed its own pod's copy): each other pod's lead
        commits its pod's copy in `tier_dir` with the same manifest, the metadata rank 0 sent first."""
        if not self.mirror.writes or self._context.ranks.rank == 0:
            return
        if outcome.metadata is not None:
            self.mirror.write_metadata(step, outcome.metadata, outcome.manifest, tier_dir)
        with self._persister.steps_held() as keep:
            self._context.held_tier().commit(step, outcome.manifest, keep=keep)

    def persist(self, outcome: CommitOutcome) -> None:
        """Every rank, once the checkpoint of `outcome` committed in memory and was counted: storage gets it behind
        training. Rank 0 queues it whole; spread over the pods, each pod's lead copies its own pod's part of the
        checkpoint rank 0 planned instead."""
        if not self._persister.spread:
            if self._context.ranks.rank == 0 and outcome.info is not None:
                self._persister.queue(outcome.info, outcome.manifest)
        elif outcome.copy_part is not None and self.mirror.writes:
            self._persister.copy_part(outcome.copy_part)

    def end_save(self) -> None:
        """The save is over: let go of its staged copies."""
        self.mirror.drop_staged()
