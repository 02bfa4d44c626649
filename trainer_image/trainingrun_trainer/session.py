"""`Run`: what any training loop needs from the platform, for the built-in trainer and your own.

A script that keeps its own loop gets the same checkpoint store, resume, preemption handling and
status reporting as the built-in trainer by using this class (see examples/custom_loop.py):

    run = trainingrun_trainer.Run.from_env()          # reads the operator's environment contract
    extra = run.resume(state)                          # newest verified checkpoint, loaded in place
    step = extra["step"] if extra else 0
    while step < total:
        ...forward, backward...
        run.wait_for_commit()                          # the save before, committed: a lost pod costs <= one interval
        ...the optimizer step...
        step += 1
        run.report(step, total_steps=total, loss=loss)  # rank 0 -> the operator -> status.progress
        stop, save = run.checkpoint_due(step)           # agreed by all ranks
        if save or stop:
            run.save(step, state, {"step": step}, blocking=stop)
        if stop:
            run.close(); sys.exit(run.PREEMPTED_EXIT_CODE)
    run.save(step, state, {"step": step}, blocking=True); run.close()

`state` is what torch.distributed.checkpoint saves (tensors, nested dicts; sharded or not);
`extra` is this rank's small state of plain values (step, RNG, sampler position): numbers, strings,
tensors, numpy arrays, lists and dicts of them; nothing read from storage may run code.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Mapping, Optional, Union

import numpy
import torch
import torch.distributed as dist

from trainingrun_api import contract, exit_codes, progress_report
from trainingrun_api.checkpoint_config import (
    CheckpointConfig,
)
from trainingrun_api.model_base import ConfigError
from trainingrun_api.progress_report import IntervalChoice, Report

from . import chaos, hangs, reporting, stragglers
from .checkpoint import CheckpointInfo, CheckpointStore, PendingSave, StorageUnavailable
from .checkpoint.listing import human_bytes
from .checkpoint.tier_files import OWN_MEMORY, PEER, STORAGE
from .context import RunContext, hang_timeout
from .own_state import OwnState
from .reporting import ProgressReporter
from .session_intervals import IntervalPolicy
from .session_reports import RunReports
from .timekeeping import ProcessClock

log = logging.getLogger("trainingrun.session")

#: The key of rank 0's extra state under which the auto interval carries a save's cost to the next process.
SAVE_COST_KEY = "trainingrun.saveCostSeconds"
#: How a log line names each of `StoreMetrics.last_restore_source`'s parts.
RESTORE_SOURCES = {"memory": "node memory", "peer": "a peer's memory", "storage": "storage"}


def restore_source_words(source: str) -> str:
    """ "node memory and storage": the places `StoreMetrics.last_restore_source` ("memory and storage") names."""
    return " and ".join(RESTORE_SOURCES.get(part, part) for part in source.split(" and "))


def restore_bytes_words(read: dict[str, int]) -> str:
    """ "5.2 MiB from own memory, 0 B from peer, 0 B from storage": where a restore's bytes came from
    (`StoreMetrics.last_restore_bytes`)."""
    return ", ".join(
        f"{human_bytes(read.get(source, 0))} from {source.replace('_', ' ')}" for source in (OWN_MEMORY, PEER, STORAGE)
    )


def init_process_group(backend: str) -> None:
    """`dist.init_process_group(backend)` that survives torchrun restarting the worker group in place.

    torchrun hands every restarted group the agent's store with no per-restart key prefix (it
    assumes a fresh store per round, which the c10d rendezvous does not give), so a restarted
    group can read the dead group's gloo/NCCL addresses and fail with "Connection refused" or
    hang. Prefixing the store with TORCHELASTIC_RESTART_COUNT keeps each group's keys its own. torch's flight
    recorder is on (hangs.py reads it when a rank hangs), and the collective timeout is above the hang watch's.
    """
    if dist.is_initialized():
        return
    env = os.environ
    hangs.enable_flight_recorder()
    timeout = hangs.collective_timeout(hang_timeout(env.get(contract.HANG_TIMEOUT_SECONDS, "")))
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"trainingrun/restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(
        backend, store=prefixed, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout
    )


class Run:
    """One attempt of a TrainingRun as seen from inside a training process: its checkpoint store (`store`), when it
    checkpoints (`intervals`, session_intervals.py) and what it reports (`reports`, session_reports.py)."""

    #: Exit with this after a SIGTERM save: the operator counts it as a preemption and retries.
    PREEMPTED_EXIT_CODE = exit_codes.PREEMPTED

    def __init__(
        self,
        context: RunContext,
        checkpoint: CheckpointConfig,
        *,
        config_hash: str = "",
        reporter: Optional[ProgressReporter] = None,
        handle_sigterm: bool = True,
    ):
        self.context = context
        self.checkpoint = checkpoint
        self.config_hash = config_hash
        for deprecation in checkpoint.deprecated_fields() if context.rank == 0 else []:
            log.warning("%s", deprecation)
        self.store = CheckpointStore.from_config(
            checkpoint, memory_tier=self._memory_tier(), run_uid=context.uid or None
        )
        if reporter is None:
            identity = Report.model_construct(
                namespace=context.namespace, name=context.name, uid=context.uid, attempt=context.attempt
            )
            reporter = reporting.from_env(identity) if context.is_rank_zero else ProgressReporter(None, identity)
        self._pending: Optional[PendingSave] = None
        #: The newest checkpoint this process committed (persisting behind: in memory).
        self.last_committed: Optional[CheckpointInfo] = None
        self.reports = RunReports(reporter, self.store, context.committed_step_file)
        self.preempted = False
        self.intervals = IntervalPolicy(checkpoint, self.store, context)
        #: Where `agree` reduces its host flags: with NCCL, a gloo group of its own, as reading an NCCL result on the
        #: host waits for every kernel queued before it (the step's backward pass); None: the default group.
        self._agreement_group: Any = None
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            self._agreement_group = dist.new_group(backend="gloo")
        if handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        #: Rank 0: compares the ranks' times before each step's first collective, and names a straggler.
        self.stragglers: Optional[stragglers.StragglerWatch] = None
        if context.is_rank_zero and context.slow_rank_factor and 1 < context.world_size <= stragglers.MAX_TIMED_RANKS:
            self.stragglers = stragglers.StragglerWatch(context.world_size, context.slow_rank_factor)
        #: Finds a rank that makes no progress, says who held the run up, and restarts the worker group (hangs.py).
        self.hang_watch = hangs.for_process(
            context, on_hang=self._report_hang, on_exit=self._last_report, process_group=self._agreement_group
        )

    def _memory_tier(self) -> Optional[str]:
        """This attempt's memory tier directory (None: off, or no /dev/shm here); earlier attempts' are removed."""
        if not self.checkpoint.memory_tier or not os.path.isdir(contract.memory_tier_root()):
            return None
        run = contract.memory_tier_key(self.context.uid or self.context.name, self.checkpoint.uri)
        directory = contract.memory_tier_dir(run, self.context.attempt)
        if self.context.local_rank == 0:  # once per node
            for earlier in glob.glob(contract.memory_tier_dirs(run)):
                if earlier != directory:
                    shutil.rmtree(earlier, ignore_errors=True)
        return directory

    @classmethod
    def from_env(cls, **kwargs: Any) -> "Run":
        """Build from TRAININGRUN_* variables and the `checkpoint` section of TRAININGRUN_CONFIG. In a script that
        configured no logging, the run's own lines (what it resumed, where from, each commit) are shown on stderr."""
        _show_logs_unless_configured()
        _config_errors_exit_permanently()
        context = RunContext.from_env()
        return cls(context, context.load_config().checkpoint, **kwargs)

    # ------------------------------------------------------------ resume and save

    def resume(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Load the newest checkpoint under the run's URI whose every file matches its manifest into
        `state` in place; returns this rank's `extra` from it, or None when there is nothing to resume.
        `state` may hold the model and its optimizer themselves (`own_state`: converted, and loaded back into
        them); a state that would leave any of the checkpoint's entries unread, or asks for entries it lacks, raises
        `StateMismatch` (a ConfigError) saying how, never a silent partial resume.

        TRAININGRUN_RESUME_FROM (the operator's last reported checkpoint) is a floor, never a pin: a
        worker group restarted within the attempt keeps the attempt's environment, and loading that
        checkpoint would throw away every one committed since. Falling below it is only logged.
        """
        if self.context.is_rank_zero:
            self.intervals.count_start(self.context.uid or self.context.name)
        with self.hang_watch.watch.pausing("restore"):
            return self._resume(state)

    def _resume(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        try:
            newest = self.store.latest_valid()
        except Exception as error:  # each fsspec backend raises its own kinds (OSError, botocore's, google's)
            raise StorageUnavailable(
                f"cannot list the checkpoints under {self.store.uri}: "
                f"{str(error).splitlines()[0][:300] if str(error) else type(error).__name__}"
            ) from error
        if self.context.is_rank_zero:
            self._check_floor(newest)
        self.reports.resumed()
        started_from = ""
        source: Union[CheckpointInfo, str, None] = newest  # or checkpoint.resumeFrom's step directory
        if source is None:
            source = self._elsewhere()
            started_from = " (checkpoint.resumeFrom: read only)" if source is not None else ""
        if source is None:
            if self.context.is_rank_zero:
                log.info("no checkpoint to resume from: starting at step 0")
            return None
        uri, step = (
            (source.uri, source.step)
            if isinstance(source, CheckpointInfo)
            else (source, int(source.rpartition("/step-")[2]))
        )
        own = OwnState(state)
        try:
            extra = self.store.load(source, own.plain, strict=True)
        except OSError as error:
            raise StorageUnavailable(f"cannot read the checkpoint {uri}: {error}") from error
        own.apply(state)
        read = restore_bytes_words(self.store.metrics.last_restore_bytes)
        if self.context.is_rank_zero:
            log.info(
                "resumed from %s at step %d in %.2f s, reading %s (%s)%s",
                uri,
                step,
                self.store.metrics.last_restore_seconds,
                restore_source_words(self.store.metrics.last_restore_source),
                read,
                started_from,
            )
        else:  # each rank reads its own part, from its own node's memory or from storage
            log.info("rank %d restored step %d reading %s", self.context.rank, step, read)
        self.intervals.resumed(step, extra.pop(SAVE_COST_KEY, None))
        return extra

    def _elsewhere(self) -> Optional[str]:
        """What a run without a checkpoint of its own starts from: checkpoint.resumeFrom (another run's step
        directory, verified by `load`, never written), or nothing. Without it, a checkpoint another run wrote below
        this run's uri stops the start (ConfigError, the same on every rank): starting over would throw that run's
        training away unseen, and this run's saves would fail at the steps that run holds."""
        if self.checkpoint.resume_from:
            return self.checkpoint.resume_from
        other = self.store.another_runs_newest
        if other is not None:
            raise ConfigError(
                f"checkpoint.uri {self.store.uri} holds checkpoints of another run (uid {other.run_uid}, newest "
                f"{other.uri}) and none of this run's: to continue from it, set spec.checkpoint.resumeFrom to "
                f"{other.uri}; to start over, give this run its own checkpoint.uri"
            )
        return None

    def _check_floor(self, source: Optional[CheckpointInfo]) -> None:
        floor = self.context.resume_from
        if not floor:
            return
        floor_step = contract.checkpoint_step(floor, self.store.uri)
        if floor_step is None:
            log.warning(
                "ignoring TRAININGRUN_RESUME_FROM=%s: not a checkpoint directory under %s", floor, self.store.uri
            )
        elif source is None or source.step < floor_step:
            log.warning(
                "the operator's resume point %s is not a valid checkpoint any more: resuming from %s",
                floor,
                source.uri if source else "the start",
            )

    def agree(self, step: int, *flags: bool, own_seconds: Optional[float] = None) -> tuple[bool, ...]:
        """(stop, save, *flags), each True on every rank when it is True on any, in ONE collective.

        A training loop that needs other per-step agreements (the built-in trainer's non-finite
        check) passes them here, so a step pays for one small all-reduce, not one per question.
        `own_seconds`: this rank's time on the step before it (stragglers.py: its data wait and forward passes, no
        collective inside), carried in the same all-reduce so that rank 0 can name a straggler; None: not measured.
        """
        return self.agree_async(step, *flags, own_seconds=own_seconds)()

    def agree_async(
        self, step: int, *flags: bool, own_seconds: Optional[float] = None
    ) -> Callable[[], tuple[bool, ...]]:
        """Start `agree` without waiting; call the result to get the answer (e.g. after backward)."""
        save_finished = self._pending is None or self._pending.done()
        if self._pending is not None and self._pending.done():
            self.report_committed()  # promptly, so the operator resumes from it after a crash
        elif self.store.persist_behind:
            self.reports.stored()  # the persister copied one to storage since
        local = (self.preempted, self.intervals.due(step, save_finished), *flags)
        if not self._distributed():
            return lambda: local
        if own_seconds is not None:
            own_seconds += chaos.slow_down(self.context, own_seconds)  # `trainingrun local --chaos-slow-rank`
        slots = (
            stragglers.agreement_slots(own_seconds, self.context.rank, self.context.world_size)
            if self.context.slow_rank_factor
            else []
        )
        # float32 holds the flags (0/1) and the times: one all-reduce (MAX) answers both.
        agreed = numpy.array([*local, *slots], dtype=numpy.float32)
        work = dist.all_reduce(
            torch.from_numpy(agreed), op=dist.ReduceOp.MAX, group=self._agreement_group, async_op=True
        )

        def result() -> tuple[bool, ...]:
            work.wait()  # host memory: no tensor call, so nothing that could wait on a GPU
            if slots and self.stragglers is not None:
                self._observe_spread(step, stragglers.read_slots(agreed[len(local) :]))
            return tuple(bool(v) for v in agreed[: len(local)])

        return result

    def _observe_spread(self, step: int, times: numpy.ndarray) -> None:
        """Rank 0: the ranks' times of one step; a straggler named (or no longer) is logged and reported."""
        assert self.stragglers is not None
        was = self.stragglers.named
        if not self.stragglers.observe(step, times):
            return
        part = self.slow_rank_report(step)
        if part is not None and self.stragglers.named is not None:
            log.warning("slow rank: %s", part.words())
        elif part is not None and was is not None:
            log.info("slow rank: %s", part.words())
        if part is not None:
            self.reports.reporter.slow_rank(part)

    def step_spread(self) -> Optional[stragglers.Spread]:
        """Rank 0: how the slowest rank's pre-collective time compares with the others' now (None elsewhere)."""
        return self.stragglers.spread if self.stragglers is not None else None

    def slow_rank_report(self, step: int) -> Optional[progress_report.SlowRank]:
        """Rank 0: the straggler named now (or, with `rank` absent, that none is) as the operator's status.slowRank
        takes it, with its pod and node as the rank said at start (hangs.py); None before the ranks compare."""
        watch = self.stragglers
        spread = None if watch is None else (watch.named or watch.spread)
        if watch is None or spread is None:
            return None
        named = watch.named is not None
        pod, node = self.hang_watch.identity(spread.slowest_rank) if named else ("", "")

        return progress_report.SlowRank.model_construct(
            rank=spread.slowest_rank if named else None,
            pod=pod or None,
            node=node or None,
            ratio=round(spread.ratio, 3),
            seconds=round(spread.slowest_seconds, 6),
            median_seconds=round(spread.median_seconds, 6),
            factor=watch.factor,
            step=watch.named_step,
        )

    def agrees_on_host(self, device: torch.device) -> bool:
        """Whether a step trained on `device` can have its loss's verdict agreed in `agree_async` itself: CPU
        training over the default (gloo) group, where the loss is in host memory as soon as it is computed, so a
        second collective after the step (about 0.9 ms between two processes on the 2-core VM, and one the step
        waits for) is not needed."""
        return device.type == "cpu" and self._agreement_group is None and self._distributed()

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        extra: Optional[Mapping[str, Any]] = None,
        *,
        model_digest: Any = "",
        blocking: bool = False,
        copy_in_background: Collection[str] = (),
    ) -> None:
        """Checkpoint (async unless blocking or `checkpoint.asyncSave` is off: then it returns once storage holds it,
        or the save failed); never raises for storage errors. `copy_in_background`: see `CheckpointStore.save`."""
        with self.hang_watch.watch.pausing("checkpoint"):  # a long save is not a hang
            writing = self._pending is not None and not self._pending.done()
            began = time.monotonic()
            self.report_committed()
            if writing:
                self.intervals.waited_for_the_save_before(step, time.monotonic() - began)
            cost = self.intervals.save_cost
            if cost is not None:
                extra = {**(extra or {}), SAVE_COST_KEY: float(cost)}
            self._pending = self.store.save(
                step,
                OwnState(state).plain,
                extra,
                config_hash=self.config_hash,
                model_digest=model_digest,
                blocking=blocking or not self.checkpoint.async_save,
                copy_in_background=copy_in_background,
            )
            if self.context.committed_step_file and self.context.local_rank == 0:  # one per node: its agent reads it
                self._pending.when_done(self.reports.tell_launcher)
            if blocking or not self.checkpoint.async_save:
                self.store.flush()  # a save that blocks returns once storage holds it, also persisting behind
            self.intervals.saved(step)

    def wait_for_commit(self) -> float:
        """Call before the optimizer step after a save: when saves commit in memory, wait for its commit (it ran
        beside this step's forward and backward passes), so that whenever a pod is lost the newest commit is at most
        `checkpoint.interval` steps behind the last step taken (a save in flight cannot commit without the lost pod,
        and steps taken beside it would be thrown away too). Raises `PeersLost` when the commit failed because a peer
        is gone, before the step is taken: let it end the process (the attempt's workers restart). Saves that commit
        to storage are not waited for: storage's pace would hold training back. The seconds waited."""
        return self.store.wait_committed() if self.store.persist_behind else 0.0

    def wait_copied(self) -> float:
        """Call before the weights change after a save: wait until the save in flight has copied the entries it
        copies in the background (`save(copy_in_background=...)`). The seconds waited."""
        return self.store.wait_copied()

    def flush(self) -> Optional[CheckpointInfo]:
        """Wait until storage holds the newest checkpoint (persisting behind, copying it now); the newest in
        storage, or None."""
        return self.store.flush()

    def load_newest(self, state: dict[str, Any]) -> Optional[tuple[CheckpointInfo, Any]]:
        """Load the newest valid checkpoint into `state` (a rollback within the run): (its info, this rank's extra), or
        None when there is none."""
        info = self.store.latest_valid()
        return None if info is None else (info, self.store.load(info, state))

    def checkpoint_due(self, step: int, own_seconds: Optional[float] = None) -> tuple[bool, bool]:
        """(stop, save): whether to stop for preemption and whether a periodic save is due.

        Collective under torch.distributed: every rank must call it at the same step, and all get
        the same answer, so a SIGTERM that reaches one rank first still stops all of them together.
        `own_seconds`: this rank's time on the step's part without a collective in it (its data and forward pass),
        for naming a straggler (stragglers.py; None: this rank is not compared).
        """
        stop, save = self.agree(step, own_seconds=own_seconds)
        return stop, save

    def report_committed(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight (the next save waits for it anyway) and report the newest checkpoint in storage
        as lastGoodCheckpoint (persisting behind, the one committed now may still be on its way there: it is
        checkpointInMemory)."""
        info = self.store.wait()
        self._pending = None
        if info is not None:
            self.last_committed = info
        self.reports.stored()
        return info

    def step_done(self, step: int) -> None:
        """`step` is done: progress for the hang watch (hangs.py), and `trainingrun local`'s faults at its end
        (chaos.py). The built-in trainer calls it after each step; a loop of its own gets it through `report`."""
        self.hang_watch.watch.progress(step)
        chaos.after_step(self.context, step, self.store.wait)

    def report(
        self,
        step: int,
        *,
        total_steps: Optional[int] = None,
        loss: Optional[float] = None,
        samples_per_second: Optional[float] = None,
        productive_seconds: Optional[float] = None,
        process_time: Optional[ProcessClock] = None,
        model_flops_per_second: Optional[float] = None,
        mfu: Optional[float] = None,
        evaluation: Optional[tuple[int, float]] = None,
    ) -> None:
        """Report progress, and where this process's time went (rank 0 only; never blocks, never raises; sent at
        the reporter's pace); `evaluation`: (step, mean held-out loss) of the last evaluation, for status and the
        local summary. Every rank: the hang watch's progress and `trainingrun local`'s chaos options, for a loop of
        its own (`step_done`)."""
        if process_time is not None:
            self.hang_watch.watch.clock = process_time  # its long phases are not hangs
        self.step_done(step)
        if not self.reports.reporter.enabled:
            return  # every step: ranks that do not report build nothing
        self.reports.progress(
            step,
            total_steps=total_steps,
            loss=loss,
            samples_per_second=samples_per_second,
            productive_seconds=productive_seconds,
            process_time=process_time,
            model_flops_per_second=model_flops_per_second,
            mfu=mfu,
            interval_choice=self.intervals.choice(),
            evaluation=evaluation,
        )

    @property
    def reporter(self) -> ProgressReporter:
        return self.reports.reporter

    def interval_choice(self) -> Optional[IntervalChoice]:
        """With checkpoint.interval.steps: auto, on rank 0: the interval now and what it is made of."""
        return self.intervals.choice()

    @property
    def checkpoint_wait_seconds(self) -> float:
        """Seconds saves waited for the save before them to commit (trainingrun_checkpoint_wait_seconds_total)."""
        return self.intervals.wait_seconds

    @property
    def saving(self) -> bool:
        """A save is being written in the background (not yet committed, nor failed)."""
        return self._pending is not None and not self._pending.done()

    def close(self, finished: bool = False) -> None:
        """Finish the last save, report it, and flush the reporter; `finished`: the run is done, so its copy in
        node memory goes too."""
        self.hang_watch.stop()
        self.report_committed()
        self.store.close()  # persisting behind: once storage holds the newest
        self.reports.stored()
        self.reports.reporter.close()
        tier = self.store.memory_tier
        if finished and tier is not None:
            shutil.rmtree(tier, ignore_errors=True)

    def _report_hang(self, diagnosis: hangs.Diagnosis) -> None:
        """The hang's diagnosis to the operator (status.lastHang, condition Hung), from whichever rank made it."""
        summary = diagnosis.summary
        limit = progress_report.MAX_DIAGNOSIS_LENGTH
        identity = self.reports.reporter.identity
        reporting.send_now(
            Report.model_construct(
                namespace=identity.namespace,
                name=identity.name,
                uid=identity.uid,
                attempt=identity.attempt,
                last_hang=progress_report.Hang.model_construct(
                    step=max(0, self.hang_watch.watch.step),
                    time=contract.rfc3339(datetime.now(timezone.utc)),
                    diagnosis=summary if len(summary) <= limit else summary[: limit - 3] + "...",
                    ranks=list(diagnosis.waited_for[: progress_report.MAX_PODS_NAMED]),
                    nodes=[node[:253] for node in diagnosis.nodes[: progress_report.MAX_PODS_NAMED]],
                ),
            )
        )

    def _last_report(self) -> None:
        """Before a hung process exits: its time, the hang included, in one last report (rank 0's reporter)."""
        clock = self.hang_watch.watch.clock
        if clock is not None and self.reports.reporter.enabled:
            self.reports.reporter.process_time(clock.snapshot())
            self.reports.reporter.close(flush_timeout=3.0)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: will checkpoint and stop after the current step")
        self.preempted = True


def _show_logs_unless_configured() -> None:
    """Python shows only warnings of a process that configured no logging: a script that only prints would never see
    where its resume read from. Then the `trainingrun` loggers get a handler of their own, at INFO; a script that
    configured logging (a root handler) decides itself."""
    ours = logging.getLogger("trainingrun")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = _UntilLoggingIsConfigured()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


class _UntilLoggingIsConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Shows the run's lines on stderr while the root logger has no handler; once the script configures its logging
    (`logging.basicConfig` after `Run.from_env`), the root's handlers show them, each line once."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _config_errors_exit_permanently() -> None:
    """A ConfigError a script lets escape (a resume into a state that does not match the checkpoint, a setting that
    cannot work) ends the process with one line and exit_codes.CONFIG_ERROR, a permanent failure: the launcher does
    not restart the worker group for it again and again, as it would for a traceback's exit 1."""
    if getattr(sys.excepthook, "trainingrun", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if not issubclass(kind, ConfigError):
            previous(kind, error, traceback)
            return
        log.error("%s", error)
        logging.shutdown()
        print(f"trainingrun: {error}", file=sys.stderr, flush=True)
        os._exit(exit_codes.CONFIG_ERROR)

    hook.trainingrun = True  # type: ignore[attr-defined]
    sys.excepthook = hook
