"""The checkpoint thread: writing a staged state (DCP, every rank) and committing it with rank 0's manifest, in node
memory or in storage (a part of `CheckpointStore`; steps 2-5 of the package's description)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

from .layout import (
    _SAVE_ERRORS,
    FILE_DIGEST,
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointInfo,
    _describe,
    _join,
    logger,
    now_rfc3339,
)
from .save_planner import ReusingSavePlanner
from .saving import _SaveJob
from .tier_files import SEGMENTS_KEY
from .tier_staging import StagedFile
from .writer import _Writer


class Committing:
    """CheckpointStore's background save: `_run` writes and commits one `_SaveJob`. State lives in
    `CheckpointStore.__init__`."""

    def _run(self, job: _SaveJob) -> Optional[CheckpointInfo]:
        """Write and commit: in the memory tier when persisting behind and every rank has room there, else to
        storage. Runs on every rank (background thread unless blocking); never raises: errors become a None result, a
        log record and failed_saves."""
        if not self.persist_behind:
            self._take_later(job)
            self._stage_later(job, None)
            job.marks.append(("staging", time.perf_counter()))
            return self._save(job, self._tier.begin(job.step, job.expected_bytes) if self._tier else None)
        with self._persist_lock:  # the persister may be taking the next step to copy
            keep = self._persist_steps()
        tier_dir = self._tier.begin(job.step, job.expected_bytes, keep=keep)
        planner = self._planner()
        self._take_later(job)
        try:
            # Agreed before staging: the memory tier when every rank has room there; DCP's planning skipped when every
            # rank's state keeps the layout of its last plan, and then each rank stages only what its plan writes.
            in_memory, repeats = self._all(
                tier_dir is not None, self._repeats(planner, {**job.state, **(job.later or {})})
            )
        except _SAVE_ERRORS as exc:
            if job.later:
                job.later = None
                job.copied.set_result(None)  # nothing to copy: training goes on
            if tier_dir is not None:
                self._tier.discard(job.step)
            self._failed(job, f"rank {self.rank} lost contact with its peers: {_describe(exc)}")
            return None
        if tier_dir is not None and not in_memory:
            self._tier.discard(job.step)
            tier_dir = None
        fast = in_memory and repeats
        staged = self._stage_later(job, tier_dir, planner if fast else None)
        job.marks.append(("staging", time.perf_counter()))
        try:
            if fast:
                # Nothing may fall back to storage now: a rank's state holds only what its plan writes.
                return self._save(
                    job, tier_dir, True, staged, planner, error=self._fast_path_error(job, staged, planner)
                )
            if in_memory:
                try:
                    (in_memory,) = self._all(not (staged is not None and staged.failed))
                except _SAVE_ERRORS as exc:
                    self._tier.discard(job.step)  # what was staged there is no checkpoint: free its memory
                    self._failed(job, f"rank {self.rank} lost contact with its peers: {_describe(exc)}")
                    return None
                if in_memory:
                    return self._save(job, tier_dir, in_memory=True, staged=staged)
                self._tier.discard(job.step)  # a rank had no room after all: every rank's save goes to storage
            return self._save(job, None)
        finally:
            if staged is not None:
                staged.close()

    def _repeats(self, planner: ReusingSavePlanner, state: dict) -> bool:
        """Whether this rank may write `state` by its last plan (`ReusingSavePlanner.repeats`); False when the planner
        cannot take it (dcp.save then plans it, and raises what is wrong with it on every rank)."""
        try:
            return planner.repeats(state, is_coordinator=self.rank == 0)
        except _SAVE_ERRORS:
            return False

    def _fast_path_error(
        self, job: _SaveJob, staged: Optional[StagedFile], planner: ReusingSavePlanner
    ) -> Optional[str]:
        """Why this rank cannot write its staged state by its last plan (every rank agreed it would), or None."""
        if staged is not None and staged.failed:
            return f"rank {self.rank} had no room in node memory to stage its state after all"
        if not self._repeats(planner, job.state):
            return f"rank {self.rank}'s staged state does not have the layout of its last plan"
        return None

    def _save(
        self,
        job: _SaveJob,
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
        step_uri = self._step_uri(job.step)
        record: dict[str, dict] = {}  # file name -> its manifest entry (size, xxh3_128, ...)
        results: Optional[list] = None  # this rank's DCP write results, for rank 0's metadata, when `planner`
        # From the staged copy, in the background, beside the write (both only read it), so training waits for
        # neither; rank 0 only writes the manifest, so only rank 0 computes it.
        digesting = (
            self._digesting.submit(job.model_digest, job.state)
            if callable(job.model_digest) and self.rank == 0 and error is None
            else None
        )
        writer: Optional[_Writer] = None
        if error is not None:
            logger.error("checkpoint step %d: %s", job.step, error)
            job.logged = True
        else:
            try:
                writer, results = self._write(job, step_uri, record, tier_dir, in_memory, staged, planner)
            except _SAVE_ERRORS as exc:
                error = _describe(exc)
                logger.error(
                    "checkpoint step %d: rank %d could not write %s: %s",
                    job.step,
                    self.rank,
                    tier_dir if in_memory else step_uri,
                    error,
                    exc_info=True,
                )
                job.logged = True
        if callable(job.model_digest):
            job.model_digest = digesting.result() if digesting is not None and error is None else ""
        job.state = None  # drop the staged copy
        job.marks.append(("model digest", time.perf_counter()))

        outcome: Optional[tuple[Optional[CheckpointInfo], Optional[str], bytes]] = None
        gathered: Optional[list] = None  # rank 0: every rank's write results, when every rank wrote by its last plan
        try:
            sent = planner.results_to_send(results) if planner is not None and results is not None else results
            statuses = self._gather_to_first((error, record, sent))
            if self.rank == 0:
                if planner is not None and not any(failed for failed, _, _ in statuses):
                    assert writer is not None  # rank 0 wrote its part
                    failed, gathered = self._finish_as_planned(
                        planner, writer, record, [done for _, _, done in statuses], tier_dir
                    )
                    statuses[0] = (failed, record, None)  # rank 0's record, the metadata's entry added
                outcome = self._commit(
                    job, step_uri, [status[:2] for status in statuses], tier_dir if in_memory else None
                )
            outcome = self._broadcast(outcome)
        except _SAVE_ERRORS as exc:  # a collective failed (peer died, timeout)
            outcome = (None, _describe(exc), b"")
            if not job.logged:
                logger.error(
                    "checkpoint step %d: rank %d lost contact with its peers: %s",
                    job.step,
                    self.rank,
                    outcome[1],
                    exc_info=True,
                )
                job.logged = True
        info, commit_error, manifest = outcome
        if planner is not None and info is not None and results is not None:
            planner.committed(job.step, results, gathered)
        elif planner is not None:
            planner.not_committed()
        if tier_dir is not None and info is not None and not in_memory:
            self._tier.commit(job.step, manifest)
        elif tier_dir is not None and info is None:
            self._tier.discard(job.step)
        if info is None:
            self._failed(job, commit_error)
            return None

        self.last_save_seconds = time.perf_counter() - job.started
        job.marks.append(("committing", time.perf_counter()))
        self.last_save_phases = {
            name: at - before for (name, at), (_, before) in zip(job.marks, [("started", job.started)] + job.marks)
        }
        self.last_save_bytes = sum(entry["size"] for entry in record.values())
        self.committed_saves += 1
        if in_memory:
            self.in_memory = info
            self._trusted[step_uri] = info.manifest_sha256  # a load reads it from the tier, checked as it reads
        else:
            self.in_memory = self.in_storage = info
        if self.rank == 0:
            self.last_save_bytes += self._manifest_bytes
            logger.info(
                "committed checkpoint step %d %s (%d bytes, %.2f s)",
                job.step,
                "in memory" if in_memory else f"to {info.uri}",
                info.size_bytes,
                self.last_save_seconds,
            )
            if in_memory:
                self._persist(info, manifest)
            else:
                try:
                    self._rotate()
                except Exception as exc:
                    logger.error("checkpoint rotation below %s failed: %s", self.uri, exc, exc_info=True)
        return info

    def _write(
        self,
        job: _SaveJob,
        step_uri: str,
        record: dict,
        tier_dir: Optional[str],
        in_memory: bool,
        staged: Optional[StagedFile],
        planner: Optional[ReusingSavePlanner],
    ) -> tuple[_Writer, Optional[list]]:
        """This rank's part of `_save`: its files written (their manifest entries into `record`); the writer, and this
        rank's write results when it wrote by `planner`'s last plan."""
        if in_memory:
            assert tier_dir is not None  # every rank has one when in_memory
            writer = _Writer(
                tier_dir,
                record,
                on_global_plan=lambda: None,
                sync_files=False,
                segments=True,
                staged=staged,
            )
        else:
            writer = _Writer(
                step_uri,
                record,
                on_global_plan=lambda: self._clear_step_dir(step_uri, job.step),
                sync_files=self._storage.local,
                tier=self._tier,
                tier_dir=tier_dir,
                **self._options,
            )
        if planner is not None:
            results: Optional[list] = planner.write_as_planned(writer, self.rank)
        else:
            results = None
            dcp.save(
                job.state,
                storage_writer=writer,
                planner=self._planner(),
                process_group=self._pg,
                no_dist=not self._distributed,
            )
        job.marks.append(("writing", time.perf_counter()))
        if tier_dir is not None and in_memory:
            self._write_digests(tier_dir, record)
        return writer, results

    def _write_digests(self, tier_dir: str, record: dict[str, dict]) -> None:
        """The digests file of each file of `record` written straight into the memory tier whose digests file is not
        written yet (its entry still holds its segments, which this takes)."""
        for name, entry in record.items():
            if SEGMENTS_KEY in entry:
                self._tier.write_digests(
                    tier_dir, name, entry["size"], FILE_DIGEST, entry[FILE_DIGEST], entry.pop(SEGMENTS_KEY)
                )

    def _finish_as_planned(
        self, planner: ReusingSavePlanner, writer: _Writer, record: dict, sent: list, tier_dir: Optional[str]
    ) -> tuple[Optional[str], Optional[list]]:
        """Rank 0, every rank having written by its last plan: write the checkpoint's metadata from the write results
        every rank `sent` (or referred to), as `dcp.save` would have before the gather (the writer records it in rank
        0's `record`). An error or None, and every rank's write results."""
        try:
            results = [planner.results_received(rank, done) for rank, done in enumerate(sent)]
            planner.finish_as_planned(writer, results)
            if tier_dir is not None:
                self._write_digests(tier_dir, record)  # the metadata's: the data files' were written before
        except _SAVE_ERRORS as exc:
            logger.error("checkpoint: rank 0 could not write the metadata: %s", _describe(exc), exc_info=True)
            return _describe(exc), None
        return None, results

    def _planner(self) -> ReusingSavePlanner:
        """DCP's planner, reusing this store's last plans while the state's layout is unchanged (`save_planner`)."""
        return ReusingSavePlanner(self._plans_key, self._planned)

    def _failed(self, job: _SaveJob, error: Optional[str]) -> None:
        self.failed_saves += 1
        if not job.logged:  # another rank failed: one record on this rank too
            logger.error("checkpoint step %d was not committed: %s", job.step, error)
        return None

    def _commit(
        self, job: _SaveJob, step_uri: str, statuses: list, tier_dir: Optional[str] = None
    ) -> tuple[Optional[CheckpointInfo], Optional[str], bytes]:
        """Rank 0: write the manifest if every rank succeeded, to storage or (`tier_dir`) into the memory tier.
        Returns (info, error, the manifest's bytes)."""
        self._manifest_bytes = 0
        failed = [(rank, err) for rank, (err, _) in enumerate(statuses) if err is not None]
        if failed:
            return None, "; ".join(f"rank {rank}: {err}" for rank, err in failed), b""
        files = {}
        for _, record in statuses:
            files.update(record)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "time": now_rfc3339(),
            "world_size": self.world_size,
            "config_hash": job.config_hash,
            "model_digest": job.model_digest,
            "torch_version": torch.__version__,
            "files": [{"path": name, **entry} for name, entry in sorted(files.items())],
        }
        if self.run_uid:
            manifest["run_uid"] = self.run_uid
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        try:
            if tier_dir is not None:
                with self._persist_lock:  # older copies go, but not the one being persisted
                    self._tier.commit(job.step, raw, keep=self._persist_steps())
                if self._tier.off is not None:
                    raise OSError(f"the memory tier is off: {self._tier.off}")
            else:
                self._storage.write_bytes(_join(step_uri, MANIFEST_NAME), raw, atomic=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("checkpoint step %d: writing the manifest failed: %s", job.step, error, exc_info=True)
            job.logged = True
            return None, f"rank 0: {error}", b""
        self._manifest_bytes = len(raw)
        manifest_sha = hashlib.sha256(raw).hexdigest()
        if tier_dir is None:
            self._trusted[step_uri] = manifest_sha
        info = CheckpointInfo(
            step=job.step,
            uri=step_uri,
            time=manifest["time"],
            size_bytes=sum(entry["size"] for entry in files.values()) + len(raw),
            valid=True,
            reason=None,
            model_digest=job.model_digest or None,  # type: ignore[arg-type]  # a str by now: _save resolved it
            world_size=self.world_size,
            manifest_sha256=manifest_sha,
            run_uid=self.run_uid,
            files={name: entry["size"] for name, entry in files.items()},
        )
        return info, None, raw
