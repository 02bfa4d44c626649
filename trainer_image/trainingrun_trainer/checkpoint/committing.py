"""`Committer`, the checkpoint thread: staging what a save left to it, writing the staged state (DCP, every rank) and
committing it with rank 0's manifest, in node memory or in storage (steps 2-5 of the package's description).

Read in order: `run` (where the save goes, agreed by every rank, and the staging), `_save` (`_write_part`: step 2;
`_decide`: steps 3 and 4; `_committed`: step 5). What several pods add is `pods.PodHooks`, called at its points."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from ..torch_internals import StateDictStager, forget_save_plans
from .context import StoreContext
from .errors import SAVE_ERRORS, describe_error
from .layout import (
    EXTRA_ENTRY,
    FILE_DIGEST,
    FORMAT_VERSION,
    MANIFEST_NAME,
    join_uri,
    logger,
    now_rfc3339,
)
from .persisting import Persister
from .pods import PodHooks, Staging
from .records import CheckpointInfo, CommitOutcome, RankPart, SaveJob
from .rotation import Rotation
from .save_planner import ReusingSavePlanner
from .tier_files import SEGMENTS_KEY
from .tier_staging import StagedFile, data_file_name, stageable, tensors_of
from .writer import CheckpointWriter

#: Numbers the stores of this process: each keeps its own plans in DCP's process-wide plan cache.
_STORES = itertools.count()


@dataclass
class WrittenPart:
    """This rank's part of a save once written (`Committer._write_part`)."""

    #: File name -> manifest entry (size, xxh3_128, ...) of each file this rank wrote.
    record: dict[str, dict]
    #: Why this rank's part is not written, or the save cannot commit (None: written).
    error: Optional[str]
    #: The writer it wrote with (None: it wrote nothing).
    writer: Optional[CheckpointWriter] = None
    #: Its DCP write results, for rank 0's metadata, when it wrote by its last plan.
    results: Optional[list] = None


def plain_state(state: Mapping[str, Any]) -> dict:
    """`state` with Stateful objects replaced by their state_dict."""
    return {key: (value.state_dict() if isinstance(value, Stateful) else value) for key, value in state.items()}


class Committer:
    """Runs one `SaveJob` at a time (`run`, on every rank: the checkpoint thread unless the save blocks) to its commit
    or its failure; never raises a storage error into training."""

    def __init__(self, context: StoreContext, rotation: Rotation, persister: Persister):
        self._context = context
        self._rotation = rotation
        self._persister = persister
        #: What a save does because the run has several pods (nothing on one pod).
        self.pods = PodHooks(context, persister)
        # Staging copies tensors into CPU buffers that every save reuses (pinned with CUDA, for fast copies):
        # containers are rebuilt, other values deep-copied.
        self._state_stager = StateDictStager(pin_memory=torch.cuda.is_available())
        self._digesting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-model-digest")
        #: This store's key in DCP's process-wide plan cache (`planner`).
        self.plans_key = f"trainingrun-checkpoint-store-{next(_STORES)}"
        self._planned: dict[str, Any] = {}  # the layout of the state the last finished plan was made from
        self._manifest_bytes = 0

    def stage(self, plain: dict) -> dict:
        """A copy of `plain` that training may not change: its tensors copied into the store's reused buffers."""
        return self._state_stager.stage(plain)

    def close(self) -> None:
        self._digesting.shutdown(wait=True)
        forget_save_plans(self.plans_key)

    def run(self, job: SaveJob) -> Optional[CheckpointInfo]:
        """Write and commit: in the memory tier when persisting behind and every rank has room there, else to
        storage. Runs on every rank (background thread unless blocking); never raises: errors become a None result, a
        log record and failed_saves."""
        self.pods.before_staging({**job.state, **(job.later or {})})
        if not self._context.persist_behind:
            self._take_later(job)
            self._stage_later(job, None)
            job.marks.append(("staging", time.perf_counter()))
            return self._save(
                job, self._context.tier.begin(job.step, job.expected_bytes) if self._context.tier else None
            )
        tier = self._context.held_tier()
        with self._persister.steps_held() as keep:  # the persister may be taking the next step to copy
            tier_dir = tier.begin(job.step, job.expected_bytes, keep=keep)
        planner = self.planner()
        self._take_later(job)
        try:
            # Agreed before staging: the memory tier when every rank has room there; DCP's planning skipped when every
            # rank's state keeps the layout of its last plan, and then each rank stages only what its plan writes.
            # With several nodes each node's lowest rank copies the other nodes' files from its own staged copy of
            # the whole state (`mirroring`): no rank stages only what its plan writes (but for a sharded state, whose
            # copies come over the network).
            in_memory, repeats = self._context.ranks.all(
                tier_dir is not None, self._repeats(planner, {**job.state, **(job.later or {})})
            )
        except SAVE_ERRORS as exc:
            if job.later:
                job.later = None
                job.copied.set_result(None)  # nothing to copy: training goes on
            if tier_dir is not None:
                self._context.held_tier().discard(job.step)
            self._lost_contact(job, exc)
            return None
        if tier_dir is not None and not in_memory:
            self._context.held_tier().discard(job.step)
            tier_dir = None
        fast = in_memory and repeats
        staging = self.pods.staging(fast, tier_dir is not None, job.later or {})
        staged = self._stage_later(job, tier_dir if staging.once else None, planner if fast else None, staging)
        job.marks.append(("staging", time.perf_counter()))
        try:
            if fast:
                # Nothing may fall back to storage now: a rank's state holds only what its plan writes.
                return self._save(
                    job, tier_dir, True, staged, planner, error=self._fast_path_error(job, staged, planner)
                )
            if in_memory:
                try:
                    (in_memory,) = self._context.ranks.all(not (staged is not None and staged.failed))
                except SAVE_ERRORS as exc:
                    # What was staged there is no checkpoint: free its memory.
                    self._context.held_tier().discard(job.step)
                    self._lost_contact(job, exc)
                    return None
                if in_memory:
                    return self._save(job, tier_dir, in_memory=True, staged=staged)
                # A rank had no room after all: every rank's save goes to storage.
                self._context.held_tier().discard(job.step)
            return self._save(job, None)
        finally:
            if staged is not None:
                staged.close()
            self.pods.end_save()

    def _repeats(self, planner: ReusingSavePlanner, state: dict) -> bool:
        """Whether this rank may write `state` by its last plan (`ReusingSavePlanner.repeats`); False when the planner
        cannot take it (dcp.save then plans it, and raises what is wrong with it on every rank)."""
        try:
            return planner.repeats(state, is_coordinator=self._context.ranks.rank == 0)
        except SAVE_ERRORS:
            return False

    def _fast_path_error(
        self, job: SaveJob, staged: Optional[StagedFile], planner: ReusingSavePlanner
    ) -> Optional[str]:
        """Why this rank cannot write its staged state by its last plan (every rank agreed it would), or None."""
        if staged is not None and staged.failed:
            return f"rank {self._context.ranks.rank} had no room in node memory to stage its state after all"
        if not self._repeats(planner, job.state):
            return f"rank {self._context.ranks.rank}'s staged state does not have the layout of its last plan"
        return None

    def _take_later(self, job: SaveJob) -> None:
        """Take the state_dict() of what save() left to the background (`job.later`), raising to the training thread
        (wait_copied) what that raises, as save() would have."""
        try:
            job.later = plain_state(job.later or {})
        except BaseException as exc:
            job.later = None
            job.copied.set_exception(exc)
            raise

    def _stage_later(
        self,
        job: SaveJob,
        tier_dir: Optional[str],
        planner: Optional[ReusingSavePlanner] = None,
        staging: Staging = Staging(),
    ) -> Optional[StagedFile]:
        """Stage the entries save() left to the background (`copy_in_background`), then tell the training thread it
        may change them. Into this rank's data file in `tier_dir` when they are CPU or CUDA tensors (stage once,
        `tier_staging`; returned), else by the stager. With `planner` (set up by its `repeats`), only the tensors this
        rank's last plan writes go into the file, and rank 0 copies what its model digest reads besides (or every
        other tensor, `staging.whole`); with `staging.copies`, the lead also stages the other pods' files."""
        later, job.later = job.later, None
        if not later:  # save() told the training thread
            return None
        staged: Optional[StagedFile] = None
        try:
            if staging.copies and tier_dir is not None:
                self.pods.stage_copies(job.step, later, tier_dir)
            if tier_dir is not None and stageable(later):
                staged = StagedFile(os.path.join(tier_dir, data_file_name(self._context.ranks.rank)))
                try:
                    if planner is None:
                        job.state.update(staged.stage(later))
                    else:
                        beside = tensors_of(later) if staging.whole else self._digest_reads(job, later)
                        job.state.update(staged.stage(later, planner.planned_tensors(), beside))
                except OSError as exc:
                    logger.warning(
                        "checkpoint step %d: rank %d cannot stage its state in %s (%s): this save %s",
                        job.step,
                        self._context.ranks.rank,
                        tier_dir,
                        describe_error(exc),
                        "fails" if planner is not None else "commits to storage",
                    )
                    staged.failed = True
                    staged.close()
            if staged is None or (staged.failed and planner is None):  # not stageable, or staged to commit to storage
                job.state.update(self.stage(later))
        except BaseException as exc:  # the training thread raises it (wait_copied), as save() would have
            job.copied.set_exception(exc)
            if staged is not None:
                staged.close()
            raise
        job.copied.set_result(None)
        return staged

    def _digest_reads(self, job: SaveJob, later: dict) -> list:
        """The tensors of `later` rank 0's model digest reads: those of its `entry` (`DigestOfEntry`), else all."""
        if self._context.ranks.rank != 0 or not callable(job.model_digest):
            return []
        entry = getattr(job.model_digest, "entry", None)
        return tensors_of(later if entry is None else later.get(entry, {}))

    def _save(
        self,
        job: SaveJob,
        tier_dir: Optional[str],
        in_memory: bool = False,
        staged: Optional[StagedFile] = None,
        planner: Optional[ReusingSavePlanner] = None,
        error: Optional[str] = None,
    ) -> Optional[CheckpointInfo]:
        """Write `job` and commit it: to storage, keeping a copy in `tier_dir` (None: none); or, `in_memory`, into
        `tier_dir` alone (completing this rank's `staged` data file, if any), rank 0 then queueing it to be
        persisted. With `planner` (every rank's `repeats`), each rank writes by its last plan, without `dcp.save`.
        `error`: this rank cannot write its part (by its last plan); it joins the commit, which then fails."""
        part = self._write_part(job, tier_dir, in_memory, staged, planner, error)  # 2
        outcome, gathered = self._decide(job, part, tier_dir, in_memory, planner)  # 3 and 4
        if planner is not None and outcome.info is not None and part.results is not None:
            planner.committed(job.step, part.results, gathered)
        elif planner is not None:
            planner.not_committed()
        if outcome.info is None:
            if tier_dir is not None:
                self._context.held_tier().discard(job.step)
            self._failed(job, outcome.error)
            return None
        if in_memory:
            assert tier_dir is not None  # every rank has one when in_memory
            self.pods.after_commit(job.step, outcome, tier_dir)
        elif tier_dir is not None:  # this node's copy of what storage committed
            self._context.held_tier().commit(job.step, outcome.manifest)
        self._committed(job, outcome.info, part.record, in_memory)  # 5
        if in_memory:
            self.pods.persist(outcome)
        return outcome.info

    def _write_part(
        self,
        job: SaveJob,
        tier_dir: Optional[str],
        in_memory: bool,
        staged: Optional[StagedFile],
        planner: Optional[ReusingSavePlanner],
        error: Optional[str],
    ) -> WrittenPart:
        """Step 2 on this rank: its files written (`_write`), the other pods' copies made (`PodHooks.after_writing`),
        rank 0's model digest computed; the staged copy dropped. Errors become the part's."""
        step_uri = self._context.step_uri(job.step)
        part = WrittenPart(record={}, error=error)
        # From the staged copy, in the background, beside the write (both only read it), so training waits for
        # neither; rank 0 only writes the manifest, so only rank 0 computes it.
        digesting = (
            self._digesting.submit(job.model_digest, job.state)
            if callable(job.model_digest) and self._context.ranks.rank == 0 and error is None
            else None
        )
        if part.error is not None:
            logger.error("checkpoint step %d: %s", job.step, part.error)
            job.logged = True
        else:
            try:
                part.writer, part.results = self._write(
                    job, step_uri, part.record, tier_dir, in_memory, staged, planner
                )
            except SAVE_ERRORS as exc:
                part.error = describe_error(exc)
                logger.error(
                    "checkpoint step %d: rank %d could not write %s: %s",
                    job.step,
                    self._context.ranks.rank,
                    tier_dir if in_memory else step_uri,
                    part.error,
                    exc_info=True,
                )
                job.logged = True
        results = part.writer.results if part.writer else []
        try:
            pods_error = self.pods.after_writing(
                job.step, job.state, part.record, results, tier_dir if part.error is None else None, in_memory
            )
        except SAVE_ERRORS as exc:  # a collective failed (peer died, timeout): so does the commit's gather
            job.lost_contact = exc
            pods_error = f"rank {self._context.ranks.rank} lost contact with its peers: {describe_error(exc)}"
        part.error = part.error or pods_error
        if callable(job.model_digest):
            job.model_digest = digesting.result() if digesting is not None and part.error is None else ""
        job.state = None  # drop the staged copy
        job.marks.append(("model digest", time.perf_counter()))
        return part

    def _decide(
        self,
        job: SaveJob,
        part: WrittenPart,
        tier_dir: Optional[str],
        in_memory: bool,
        planner: Optional[ReusingSavePlanner],
    ) -> tuple[CommitOutcome, Optional[list]]:
        """Steps 3 and 4: every rank's part gathered to rank 0, which commits when every rank wrote (`_commit`) and
        broadcasts the outcome. The outcome (the same on every rank), and rank 0's every rank's write results when
        every rank wrote by its last plan."""
        gathered: Optional[list] = None
        try:
            tier = self._context.tier
            mine = RankPart(
                error=part.error,
                record=part.record,
                sent=planner.results_to_send(part.results)
                if planner is not None and part.results is not None
                else part.results,
                short_of_room=tier is not None and (tier.short_of_room or self.pods.short_of_room),
                part_done=self.pods.part_done,
            )
            parts: list[RankPart] = self._context.ranks.gather_to_first(mine)
            outcome: Optional[CommitOutcome] = None
            if self._context.ranks.rank == 0:
                self._note_pods_short(job.step, [each.short_of_room for each in parts])
                if planner is not None and not any(each.error for each in parts):
                    assert part.writer is not None  # rank 0 wrote its part
                    failed, gathered = self._finish_as_planned(
                        planner, part.writer, part.record, [each.sent for each in parts], tier_dir
                    )
                    # Rank 0's own record, not the gathered copy: it now holds the metadata's entry too.
                    parts[0] = replace(parts[0], error=failed, record=part.record)
                outcome = self._commit(job, self._context.step_uri(job.step), parts, tier_dir if in_memory else None)
                if in_memory:
                    self.pods.at_commit(outcome, parts, tier_dir if planner is not None else None)
            outcome = self._context.ranks.broadcast(outcome)
            assert outcome is not None  # rank 0's
            return outcome, gathered
        except SAVE_ERRORS as exc:  # a collective failed (peer died, timeout)
            job.lost_contact = exc
            if not job.logged:
                logger.error(
                    "checkpoint step %d: rank %d lost contact with its peers: %s",
                    job.step,
                    self._context.ranks.rank,
                    describe_error(exc),
                    exc_info=True,
                )
                job.logged = True
            return CommitOutcome(info=None, error=describe_error(exc)), None

    def _committed(self, job: SaveJob, info: CheckpointInfo, record: dict, in_memory: bool) -> None:
        """Step 5: `info` committed; its figures counted, rank 0 says so and rotates storage after a commit there."""
        metrics = self._context.metrics
        metrics.last_save_seconds = time.perf_counter() - job.started
        job.marks.append(("committing", time.perf_counter()))
        metrics.last_save_phases = {
            name: at - before for (name, at), (_, before) in zip(job.marks, [("started", job.started)] + job.marks)
        }
        metrics.last_save_bytes = sum(entry["size"] for entry in record.values())
        metrics.committed_saves += 1
        if in_memory:
            self._context.in_memory = info
            self._context.trust(info)  # a load reads it from the tier, checked as it reads
        else:
            self._context.in_memory = self._context.in_storage = info
        if self._context.ranks.rank == 0:
            metrics.last_save_bytes += self._manifest_bytes
            logger.info(
                "committed checkpoint step %d %s (%d bytes, %.2f s)",
                job.step,
                "in memory" if in_memory else f"to {info.uri}",
                info.size_bytes,
                metrics.last_save_seconds,
            )
            if not in_memory:
                self._rotation.rotate_logging_errors()

    def _note_pods_short(self, step: int, short: list[bool]) -> None:
        """Rank 0: the pods whose memory had no room for `step` (by each rank's flag), for status; kept while none
        was ever short."""
        if not self._context.pods:
            return
        pods = sorted({self._context.pods[rank] for rank, flag in enumerate(short) if flag})
        if pods or self._context.memory_short is not None:
            self._context.memory_short = (step, pods)

    def _write(
        self,
        job: SaveJob,
        step_uri: str,
        record: dict,
        tier_dir: Optional[str],
        in_memory: bool,
        staged: Optional[StagedFile],
        planner: Optional[ReusingSavePlanner],
    ) -> tuple[CheckpointWriter, Optional[list]]:
        """This rank's part of `_save`: its files written (their manifest entries into `record`); the writer, and this
        rank's write results when it wrote by `planner`'s last plan."""
        if in_memory:
            assert tier_dir is not None  # every rank has one when in_memory
            writer = CheckpointWriter(
                tier_dir,
                record,
                on_global_plan=lambda: None,
                sync_files=False,
                segments=True,
                staged=staged,
                replicated_apart_from=self._replicated_apart_from(),
            )
        else:
            writer = CheckpointWriter(
                step_uri,
                record,
                on_global_plan=lambda: self._rotation.clear_step_dir(step_uri, job.step),
                sync_files=self._context.storage.local,
                tier=self._context.tier,
                tier_dir=tier_dir,
                replicated_apart_from=self._replicated_apart_from(),
                **self._context.options,
            )
        if planner is not None:
            results: Optional[list] = planner.write_as_planned(writer, self._context.ranks.rank)
        else:
            results = None
            dcp.save(
                job.state,
                storage_writer=writer,
                planner=self.planner(),
                process_group=self._context.ranks.group,
                no_dist=not self._context.ranks.distributed,
            )
        job.marks.append(("writing", time.perf_counter()))
        if tier_dir is not None and in_memory:
            self._write_digests(tier_dir, record)
        return writer, results

    def _replicated_apart_from(self) -> Optional[str]:
        """This rank's own entry, when its replicated items go into a file of their own (`mirroring`); else None."""
        return EXTRA_ENTRY.format(rank=self._context.ranks.rank) if self.pods.keeps_replicated_apart else None

    def _write_digests(self, tier_dir: str, record: dict[str, dict]) -> None:
        """The digests file of each file of `record` written straight into the memory tier whose digests file is not
        written yet (its entry still holds its segments, which this takes)."""
        for name, entry in record.items():
            if SEGMENTS_KEY in entry:
                self._context.held_tier().write_digests(
                    tier_dir, name, entry["size"], FILE_DIGEST, entry[FILE_DIGEST], entry.pop(SEGMENTS_KEY)
                )

    def _finish_as_planned(
        self, planner: ReusingSavePlanner, writer: CheckpointWriter, record: dict, sent: list, tier_dir: Optional[str]
    ) -> tuple[Optional[str], Optional[list]]:
        """Rank 0, every rank having written by its last plan: write the checkpoint's metadata from the write results
        every rank `sent` (or referred to), as `dcp.save` would have before the gather (the writer records it in rank
        0's `record`). An error or None, and every rank's write results."""
        try:
            results = [planner.results_received(rank, done) for rank, done in enumerate(sent)]
            planner.finish_as_planned(writer, results)
            if tier_dir is not None:
                self._write_digests(tier_dir, record)  # the metadata's: the data files' were written before
        except SAVE_ERRORS as exc:
            logger.error("checkpoint: rank 0 could not write the metadata: %s", describe_error(exc), exc_info=True)
            return describe_error(exc), None
        return None, results

    def planner(self) -> ReusingSavePlanner:
        """DCP's planner, reusing this store's last plans while the state's layout is unchanged (`save_planner`). A
        sharded state on several pods has rank 0 write every replicated item, into a file of its own that every pod
        keeps (`mirroring`)."""
        return ReusingSavePlanner(self.plans_key, self._planned, replicated_to_rank0=self.pods.keeps_replicated_apart)

    def _lost_contact(self, job: SaveJob, exc: BaseException) -> None:
        """A collective of `job` failed: a peer is gone (or timed out); the save fails."""
        job.lost_contact = exc
        self._failed(job, f"rank {self._context.ranks.rank} lost contact with its peers: {describe_error(exc)}")

    def _failed(self, job: SaveJob, error: Optional[str]) -> None:
        self._context.metrics.failed_saves += 1
        if not job.logged:  # another rank failed: one record on this rank too
            logger.error("checkpoint step %d was not committed: %s", job.step, error)
        return None

    def _commit(
        self, job: SaveJob, step_uri: str, parts: list[RankPart], tier_dir: Optional[str] = None
    ) -> CommitOutcome:
        """Rank 0: write the manifest if every rank succeeded, to storage or (`tier_dir`) into the memory tier."""
        self._manifest_bytes = 0
        failed = [(rank, part.error) for rank, part in enumerate(parts) if part.error is not None]
        if failed:
            return CommitOutcome(info=None, error="; ".join(f"rank {rank}: {err}" for rank, err in failed))
        files = {}
        for part in parts:
            files.update(part.record)
        committed_at = now_rfc3339()
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "time": committed_at,
            "world_size": self._context.ranks.world_size,
            "config_hash": job.config_hash,
            "model_digest": job.model_digest,
            "torch_version": torch.__version__,
            "files": [{"path": name, **entry} for name, entry in sorted(files.items())],
        }
        if self._context.run_uid:
            manifest["run_uid"] = self._context.run_uid
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        try:
            if tier_dir is not None:
                tier = self._context.held_tier()
                with self._persister.steps_held() as keep:  # older copies go, but not the one being persisted
                    tier.commit(job.step, raw, keep=keep)
                if tier.off is not None:
                    raise OSError(f"the memory tier is off: {tier.off}")
            else:
                self._context.storage.write_bytes(join_uri(step_uri, MANIFEST_NAME), raw, atomic=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("checkpoint step %d: writing the manifest failed: %s", job.step, error, exc_info=True)
            job.logged = True
            return CommitOutcome(info=None, error=f"rank 0: {error}")
        self._manifest_bytes = len(raw)
        manifest_sha = hashlib.sha256(raw).hexdigest()
        if tier_dir is None:
            self._context.trusted[step_uri] = manifest_sha
        info = CheckpointInfo(
            step=job.step,
            uri=step_uri,
            time=committed_at,
            size_bytes=sum(entry["size"] for entry in files.values()) + len(raw),
            valid=True,
            reason=None,
            model_digest=job.model_digest or None,  # type: ignore[arg-type]  # a str by now: _save resolved it
            world_size=self._context.ranks.world_size,
            manifest_sha256=manifest_sha,
            run_uid=self._context.run_uid,
            files={name: entry["size"] for name, entry in files.items()},
        )
        return CommitOutcome(info=info, manifest=raw)
