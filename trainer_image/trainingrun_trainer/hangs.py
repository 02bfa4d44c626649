"""Finding a hang from inside the run: a rank that makes no step progress for longer than it should, and what every
rank was doing then (hang_analysis.py names who held the run up).

How long is too long (`StepWatch`): spec.recovery.hangTimeoutSeconds, or with `auto` (the default)
max(FLOOR_SECONDS, STEP_FACTOR x the typical time between steps) over the last TYPICAL_WINDOW steps. Phases known to
be long do not count and restart the wait when they end: restoring, saving a checkpoint, evaluating (the process
clock's phases, timekeeping.py, and `pausing` for a loop of one's own), unless the rank has waited in a collective
for longer than the limit there (a save waiting for a peer that hung). Nor do the first WARMUP_STEPS steps of a
process (compiling, warming up, data start-up): the operator's stallTimeoutSeconds is the guard there, and for a
whole pod frozen, which no thread of it can report.

What happens then (`HangWatch`, a thread of each rank): the rank that finds it asks every rank through the
rendezvous store (not through the process group, which is what hangs); each rank that can still run answers with
a dump (hang_analysis.RankDump: its flight recorder's collectives and its training thread's stack). A rank in a long
phase answers so and the watch waits again: no false alarm because one rank saves longer than the others. Otherwise
the asking rank diagnoses (within EXCHANGE_SECONDS: a rank that has not answered by then did not answer), logs the
diagnosis as `hang diagnosis: ...`, and every rank that answered exits with exit_codes.HUNG: torchrun restarts the
worker group in place, which resumes from memory. torch's own collective timeout (`collective_timeout`) stays
above the watch's, as the backstop for what the watch cannot see.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Collection, Iterator, Optional

from trainingrun_api import contract, exit_codes

from .hang_analysis import MAX_FRAMES, Collective, Diagnosis, DumpError, GroupState, RankDump, diagnose
from .hang_store import KILL_PREFIX, MAX_KILLS, group_key, shared_store
from .timekeeping import start_ticks

log = logging.getLogger("trainingrun.hangs")

#: With `auto`: never less than this many seconds without progress, whatever the step time.
FLOOR_SECONDS = 30.0
#: With `auto`: this many typical steps without progress is a hang.
STEP_FACTOR = 10.0
#: Steps a process completes before the watch arms (the first compiles and warms up).
WARMUP_STEPS = 3
#: Steps whose times make the typical step time.
TYPICAL_WINDOW = 32
#: Phases that may take long and are not a hang (timekeeping.KINDS).
LONG_PHASES = frozenset({"restore", "checkpoint", "eval"})
#: Seconds the asking rank waits for the other ranks' answers; one that has not answered by then did not answer.
EXCHANGE_SECONDS = 5.0
#: How often each rank's watch looks at its own progress and at the store for a question.
POLL_SECONDS = 1.0
#: The flight recorder's buffer (entries) when the environment does not set one: collectives of the last few steps.
FLIGHT_RECORDER_ENTRIES = "2000"
#: torch's collective timeout never below this: a rank may wait in a collective for a peer's long save.
MIN_COLLECTIVE_TIMEOUT_SECONDS = 600


def collective_timeout(hang_timeout: Optional[float]) -> timedelta:
    """The timeout torch gives collectives: well above the watch's (three times a fixed one), so the watch, which
    says who hung, fires first; at least MIN_COLLECTIVE_TIMEOUT_SECONDS."""
    fixed = 3 * hang_timeout if hang_timeout else 0.0
    return timedelta(seconds=max(MIN_COLLECTIVE_TIMEOUT_SECONDS, fixed))


def enable_flight_recorder() -> None:
    """torch's flight recorder on (a bounded ring of the last collectives), before the process group exists."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


class StepWatch:
    """Whether this rank's training has gone without progress for too long. `timeout`: seconds, None for auto,
    0 for off."""

    def __init__(
        self,
        timeout: Optional[float],
        now: Callable[[], float] = time.monotonic,
        collective_age: Callable[[], float] = lambda: 0.0,
    ):
        self.timeout = timeout
        self._now = now
        #: Seconds the oldest collective in flight has waited (`oldest_collective_seconds`): a long phase stuck in one
        #: waits for a peer, not for its own work, and is no excuse.
        self._collective_age = collective_age
        self.step = -1  #: the newest step completed
        self.steps_seen = 0  #: steps completed by this process
        self.last_progress = now()
        self.step_seconds: deque[float] = deque(maxlen=TYPICAL_WINDOW)
        self._pauses: list[str] = []
        self._resumed_at = -float("inf")
        self.clock: Any = None  #: a timekeeping.ProcessClock whose long phases count as pauses

    def progress(self, step: int) -> None:
        """`step` completed (a step seen already changes nothing)."""
        if step <= self.step:
            return
        now = self._now()
        if self.steps_seen >= 1 and self.step >= 0:
            self.step_seconds.append((now - self._since()) / (step - self.step))
        self.step, self.steps_seen, self.last_progress = step, self.steps_seen + 1, now

    @contextmanager
    def pausing(self, phase: str) -> Iterator[None]:
        """A phase known to be long (a save, a restore, an evaluation): not a hang, and the wait starts after it."""
        self._pauses.append(phase)
        try:
            yield
        finally:
            self._pauses.remove(phase)
            self._resumed_at = self._now()

    def phase(self) -> str:
        """The long phase this rank is in now, doing its own work ("" when none, or when it has waited in a
        collective for longer than the limit: then it waits for a peer, which may be hung)."""
        current = self._pauses[-1] if self._pauses else getattr(self.clock, "phase", "")
        if current not in LONG_PHASES and not self._pauses:
            return ""
        limit = self.limit()
        if limit is not None and self._now() - self._since() >= limit and self._collective_age() >= limit:
            return ""
        return current

    def _since(self) -> float:
        """When the wait began: the last progress, or the end of a long phase after it."""
        return max(self.last_progress, self._resumed_at, getattr(self.clock, "phase_ended", -float("inf")))

    def limit(self) -> Optional[float]:
        """Seconds without progress that are a hang now; None while the watch is off or not armed yet."""
        if self.timeout == 0 or self.steps_seen < WARMUP_STEPS:
            return None
        if self.timeout is not None:
            return self.timeout
        typical = statistics.median(self.step_seconds) if self.step_seconds else 0.0
        return max(FLOOR_SECONDS, STEP_FACTOR * typical)

    def overdue(self) -> Optional[float]:
        """Seconds without progress when they are past the limit and no long phase is on; else None."""
        limit = self.limit()
        if limit is None or self.phase():
            return None
        waited = self._now() - self._since()
        return waited if waited >= limit else None

    def waited(self) -> float:
        """Seconds since the last progress (or the end of a long phase after it)."""
        return max(0.0, self._now() - self._since())

    def rearm(self) -> None:
        """Wait a whole limit again (a peer was in a long phase)."""
        self._resumed_at = self._now()


def _stdlib_paths() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib")}
    return tuple(os.path.join(path, "") for path in paths)


def _short(filename: str) -> str:
    """A frame's file as its package path (torch/utils/data/dataloader.py), not the machine's."""
    marker = os.sep + "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    parts = filename.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 1 else filename


def thread_frames(thread_id: Optional[int] = None) -> tuple[str, ...]:
    """The innermost MAX_FRAMES frames of a thread (the main thread by default) outside the standard library
    (a queue's or a lock's wait says less than the caller that waits), innermost last."""
    ident = thread_id if thread_id is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident or 0)
    if frame is None:
        return ()
    stdlib = _stdlib_paths()
    frames = [
        f"{_short(entry.filename)}:{entry.lineno} in {entry.name}"
        for entry in traceback.extract_stack(frame)
        if not entry.filename.startswith(stdlib)
    ]
    return tuple(frames[-MAX_FRAMES:])


def _recorder() -> Optional[dict[str, Any]]:
    """torch's flight recorder's dump in this process; None where there is none (an older torch, the recorder off)."""
    try:
        from .torch_internals import flight_recorder_json

        data = json.loads(flight_recorder_json())
    except Exception as error:  # a recorder that cannot dump: the stack still helps
        log.debug("no flight recorder dump: %s", error)
        return None
    return data if isinstance(data, dict) else None


def _in_flight(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        e for e in data.get("entries") or [] if isinstance(e, dict) and not e.get("retired") and not e.get("is_p2p")
    ]


def oldest_collective_seconds() -> float:
    """Seconds the oldest collective in flight in this process has waited (0: none, or no recorder)."""
    data = _recorder()
    created = [int(e.get("time_created_ns") or 0) for e in _in_flight(data)] if data else []
    created = [ns for ns in created if ns > 0]
    return max(0.0, (time.time_ns() - min(created)) / 1e9) if created else 0.0


def flight_recorder() -> tuple[dict[str, GroupState], tuple[Collective, ...], bool]:
    """(each process group's newest enqueued and completed collective, the collectives in flight, whether a flight
    recorder answered) from torch's flight recorder in this process."""
    data = _recorder()
    if data is None:
        return {}, (), False
    groups = {
        str(pg): GroupState(
            int(status.get("last_enqueued_collective", -1)), int(status.get("last_completed_collective", -1))
        )
        for pg, status in (data.get("pg_status") or {}).items()
    }
    in_flight = tuple(
        Collective(
            str(entry.get("pg_id", "")),
            int(entry.get("collective_seq_id", -1)),
            str(entry.get("profiling_name", "")),
            str(entry.get("input_sizes", "")),
        )
        for entry in _in_flight(data)
    )[-32:]
    return groups, in_flight, bool(groups)


class HangWatch:
    """The thread that turns a rank's `StepWatch` into a diagnosis and an exit (see the module's docstring).
    `store`: a torch.distributed Store the ranks share outside the process group (None: this rank alone)."""

    def __init__(
        self,
        watch: StepWatch,
        *,
        rank: int,
        world_size: int,
        pod: str,
        node: str,
        store: Any = None,
        launchers: Any = None,
        on_hang: Optional[Callable[[Diagnosis], None]] = None,
        on_exit: Optional[Callable[[], None]] = None,
        exit: Callable[[int], None] = os._exit,
    ):
        self.watch, self.rank, self.world_size, self.pod, self.node = watch, rank, world_size, pod, node
        self.store = store
        #: Where each pod's launcher reads the processes it is asked to kill (`LauncherKills`): the store's root
        #: under KILL_PREFIX, which the launcher knows, unlike this group's key.
        self.launchers = launchers
        self.on_hang = on_hang
        self.on_exit = on_exit  #: the process's last word before it exits (its time, counted as hang)
        self._exit = exit
        self.round = 0  #: questions asked in this worker group so far
        self.diagnosis: Optional[Diagnosis] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.store is not None:  # who this rank is, for naming it should it not answer
            self.store.set(
                f"identity/{self.rank}", json.dumps([self.pod, self.node, os.getpid(), start_ticks(os.getpid())])
            )
        self._thread = threading.Thread(target=self._run, name="trainingrun-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.check()
            except Exception as error:  # the store went (its host frozen or gone): go on alone
                if self.store is None:
                    log.warning("the hang watch failed (%s: %s); it stops", type(error).__name__, error)
                    return
                log.warning("the hang watch's store does not answer (%s); this rank answers alone from now", error)
                self.store = None

    def check(self) -> Optional[str]:
        """One look: "hang" when this rank exited (or would have), "busy" when a peer's long phase excused the
        wait, None when nothing happened."""
        overdue = self.watch.overdue()
        asked = self.store is not None and self.store.check([f"asked/{self.round}"])
        if overdue is None and not asked:
            return None
        if self.store is None:
            return self._conclude({self.rank: self._dump()}, overdue or 0.0)
        if overdue is not None and not asked:
            owner = self.store.compare_set(f"asked/{self.round}", "", str(self.rank)).decode()
            asking = owner == str(self.rank)
        else:
            asking = self.store.get(f"asked/{self.round}").decode() == str(self.rank)
        self.store.set(f"dump/{self.round}/{self.rank}", self._dump().as_json())
        if asking:
            dumps = self._gather()
            busy = sorted((r, d.phase) for r, d in dumps.items() if d.phase)
            silent = {rank for rank in range(self.world_size) if rank not in dumps}
            verdict = f"busy:{busy[0][0]}:{busy[0][1]}" if busy else "hang:" + ",".join(map(str, sorted(silent)))
            self.store.set(f"verdict/{self.round}", verdict)
            if not busy:
                self._end_silent_pod_mates(silent)
                self._ask_launchers_to_kill(silent)
                return self._conclude(dumps, overdue or 0.0, answered=list(dumps))
        else:
            verdict = self._verdict()
        if verdict.startswith("busy"):
            _, rank, phase = verdict.split(":", 2)
            log.info(
                "no progress for a while, but rank %s is in a long phase (%s): not a hang; waiting on", rank, phase
            )
            self.round += 1
            self.watch.rearm()
            return "busy"
        silent = {int(word) for word in verdict.partition(":")[2].split(",") if word.isdigit()}
        self._end_silent_pod_mates(silent)
        return self._exit_hung(None, answered=[r for r in range(self.world_size) if r not in silent])

    def _dump(self) -> RankDump:
        groups, in_flight, recorder = flight_recorder()
        return RankDump(
            rank=self.rank,
            step=self.watch.step,
            pod=self.pod,
            node=self.node,
            phase=self.watch.phase(),
            frames=thread_frames(),
            groups=groups,
            in_flight=in_flight,
            recorder=recorder,
        )

    def _gather(self) -> dict[int, RankDump]:
        """The answers of every rank that gave one within EXCHANGE_SECONDS (malformed ones are logged and left out)."""
        keys = {rank: f"dump/{self.round}/{rank}" for rank in range(self.world_size)}
        deadline = time.monotonic() + EXCHANGE_SECONDS
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.2)  # polling the store: a missing key is an answer not given yet
        dumps: dict[int, RankDump] = {}
        for rank, key in keys.items():
            if not self.store.check([key]):
                continue
            try:
                dump = RankDump.parse(self.store.get(key))
            except DumpError as error:
                log.warning("rank %d's hang dump is unreadable: %s", rank, error)
                continue
            if dump.rank == rank:
                dumps[rank] = dump
        return dumps

    def identity(self, rank: int) -> tuple[str, str]:
        """(pod, node) of `rank` as it said when it started; ("", "") where unknown (no store, or it has not said)."""
        try:
            known = self._identities((rank,)).get(rank)
        except Exception:  # the store went: the rank alone names it
            known = None
        return (known[0], known[1]) if known is not None else ("", "")

    def _identities(self, ranks: Optional[Collection[int]] = None) -> dict[int, tuple[str, str, int, int]]:
        """rank -> (pod, node, pid, start time) as each rank said when it started."""
        known: dict[int, tuple[str, str, int, int]] = {}
        for rank in range(self.world_size) if ranks is None else ranks:
            key = f"identity/{rank}"
            if self.store is not None and self.store.check([key]):
                try:
                    pod, node, pid, started = json.loads(self.store.get(key))
                    known[rank] = (str(pod)[:253], str(node)[:253], int(pid), int(started))
                except (ValueError, TypeError):
                    continue
        return known

    def _end_silent_pod_mates(self, silent: Collection[int]) -> None:
        """SIGKILL the ranks of this pod that did not answer (a stopped or frozen process ignores the SIGTERM
        torchrun's agent stops a group with, and the agent waits 30 s before it kills): the group restarts at once.
        Only the process the rank named when it started (same pid and start time), never one that took its pid."""
        identities = self._identities()
        for rank in silent:
            pod, node, pid, started = identities.get(rank, ("", "", 0, 0))
            if (pod, node) != (self.pod, self.node) or pid <= 1 or not started or start_ticks(pid) != started:
                continue
            log.warning("rank %d (pid %d) did not answer: killing it so that the worker group restarts now", rank, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _ask_launchers_to_kill(self, silent: Collection[int]) -> None:
        """Ask the launcher of each other pod to SIGKILL its ranks that did not answer (a stopped process with no
        pod-mate to end it would hold its agent: torchrun waits 30 s on a stopped worker, and once an agent was seen
        never to rejoin). Each launcher checks the process is its own worker, started when the rank said."""
        if self.launchers is None or not silent:
            return
        by_pod: dict[str, list[list[int]]] = {}
        for pod, _, pid, started in self._identities(sorted(silent)).values():
            if pod != self.pod and pid > 1 and started:
                by_pod.setdefault(pod, []).append([pid, started])
        for pod, processes in by_pod.items():
            try:
                self.launchers.set(pod, json.dumps(processes[:MAX_KILLS]))
            except Exception as error:  # the launcher's kill only saves time; the hang is diagnosed all the same
                log.warning("could not ask pod %s's launcher to kill its silent ranks: %s", pod, error)

    def _verdict(self) -> str:
        """The asking rank's verdict; "hang" when it gives none in time (it may be the one that hangs now)."""
        key = f"verdict/{self.round}"
        deadline = time.monotonic() + EXCHANGE_SECONDS + 5
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return self.store.get(key).decode()
            time.sleep(0.2)  # polling the store for the asking rank's word
        return "hang"

    def _conclude(self, dumps: dict[int, RankDump], waited: float, answered: Collection[int] = ()) -> str:
        places = {rank: (pod, node) for rank, (pod, node, _, _) in self._identities().items()}
        self.diagnosis = diagnose(self.world_size, dumps, places, waited)
        log.error("hang diagnosis: %s", self.diagnosis.summary)
        for line in self.diagnosis.details:
            log.error("hang diagnosis:   %s", line)
        return self._exit_hung(self.diagnosis, answered=answered)

    def _exit_hung(self, diagnosis: Optional[Diagnosis], answered: Collection[int] = ()) -> str:
        """Report, then exit HUNG once every rank that `answered` has made its last report too (or EXCHANGE_SECONDS
        passed): the first exit breaks the others' collectives, and their training threads would end them before
        their watch reported."""
        if diagnosis is None:
            frames = thread_frames()
            log.error(
                "rank %d: the run is hung; this rank was at %s; exiting so the worker group restarts",
                self.rank,
                frames[-1] if frames else "no frame",
            )
        if diagnosis is not None and self.on_hang is not None:
            try:
                self.on_hang(diagnosis)
            except Exception as error:  # the exit matters more than the report
                log.warning("could not report the hang: %s", error)
        clock = self.watch.clock
        if clock is not None:
            clock.add("hang", self.watch.waited())
        if self.on_exit is not None:
            try:
                self.on_exit()
            except Exception as error:  # the exit matters more
                log.warning("could not report this process's time: %s", error)
        try:
            if answered and self.store is not None:
                self.store.set(f"done/{self.round}/{self.rank}", "1")
            keys = [f"done/{self.round}/{rank}" for rank in answered if rank != self.rank]
            deadline = time.monotonic() + EXCHANGE_SECONDS
            while keys and self.store is not None and time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.1)  # polling the store for the other ranks' last reports
        except Exception as error:  # a store gone: exit all the same
            log.warning("the hang watch's store does not answer (%s)", error)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(exit_codes.HUNG)
        return "hang"


def for_process(
    context: Any,
    on_hang: Optional[Callable[[Diagnosis], None]] = None,
    on_exit: Optional[Callable[[], None]] = None,
    process_group: Any = None,
) -> HangWatch:
    """This process's watch (context: a RunContext), started under torchrun unless the timeout is 0; elsewhere (a
    script run as it is, a test) it only keeps the watch's figures."""
    watch = StepWatch(context.hang_timeout_seconds, collective_age=oldest_collective_seconds)
    running = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and context.hang_timeout_seconds != 0
    store = None
    group = group_key(process_group) if running else None
    launchers = None
    if group is not None:
        try:
            import torch.distributed as dist

            root = shared_store()
            if root is not None:  # keys below this group's (`group_key`), and the launchers' below KILL_PREFIX
                store = dist.PrefixStore(f"trainingrun/hangs/{group}", root)
                launchers = dist.PrefixStore(KILL_PREFIX, root) if os.environ.get(contract.HANG_STORE) else None
        except Exception as error:  # no store: each rank still finds and diagnoses a hang by itself
            log.warning(
                "the hang watch has no store to ask the other ranks through (%s); each rank answers alone", error
            )
    hang_watch = HangWatch(
        watch,
        rank=context.rank,
        world_size=context.world_size,
        pod=context.pod_name,
        node=context.node_name,
        store=store,
        launchers=launchers,
        on_hang=on_hang,
        on_exit=on_exit,
    )
    if running:
        hang_watch.start()
    return hang_watch
