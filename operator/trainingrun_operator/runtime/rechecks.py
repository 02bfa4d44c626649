"""When a run is reconciled without an event: at the time its decision can change, when Warning Events about its
Pending attempt change, after a failed reconcile, and in a full sweep now and then.

Events (the run's, its jobs', its pods') trigger most reconciles. The rest come from here, each for a reason:
- **a due time**: `reconcile.decide` says when its decision may change with nothing but the clock (a backoff that
  ends, a stall timeout, a failure's grace for evidence, the old pods' grace period); the handlers add a refused
  child's backoff and when a Pending attempt starts having its Warning Events read;
- **Warning Events**: they are not watched (the busiest kind there is). Each namespace with attempts Pending for a
  while has them read once per reconcile interval, and only runs whose job's warnings changed are reconciled;
- **a failed reconcile** (an API error): again after the reconcile interval;
- **a full sweep** every `resync_seconds`, and when this replica starts acting: a safety net, not the clock.
A sweep of every run every 10 s (as before) was a reconcile per run per interval: 2,000 a second with 20,000 runs.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Awaitable, Callable, Iterable, Optional, Protocol

from trainingrun_api.contract import parse_time

from .kube import ApiError

log = logging.getLogger("trainingrun.operator")

Key = tuple[str, str]  # (namespace, name) of a TrainingRun

#: The most Warning Events read from one namespace at a time (500 a request): Events live an hour, so a namespace holds
#: more only while something fails at a high rate, and each read is held in memory until the next.
WARNING_EVENTS_READ = 2000


class RecheckSettings(Protocol):
    """The operator's settings the rechecks read (`settings.Settings` has them)."""

    @property
    def reconcile_interval_seconds(self) -> float: ...

    @property
    def resync_seconds(self) -> float: ...

    @property
    def pending_events_after_seconds(self) -> float: ...


#: Reads a namespace's Warning Events, at most `WARNING_EVENTS_READ`: (the events, whether that was all of them).
ListWarnings = Callable[[str], Awaitable[tuple[list[dict[str, Any]], bool]]]


@dataclass
class WarningsRead:
    at: float  #: time.monotonic() of the read
    events: list[dict[str, Any]]  #: what reconcile needs of each Warning Event
    complete: bool = True  #: False when the namespace held more than were read (`WARNING_EVENTS_READ`)


def jobs_it_may_be_about(name: str) -> set[str]:
    """The job names an Event about object `name` may be about: the job itself, or its pods (<job>-worker-<i>), so
    `name` or a part of it before a '-'."""
    return {name[:cut] for cut in [len(name), *(i for i, c in enumerate(name) if c == "-")]}


def about_job(name: str, job_name: str) -> bool:
    return job_name in jobs_it_may_be_about(name)


def fingerprint(warnings: list[dict[str, Any]]) -> int:
    return hash(tuple((w.get("reason"), w.get("message"), w["involvedObject"].get("name")) for w in warnings))


class Rechecks:
    """Due times (time.monotonic()) of runs, earliest first, the runs whose Warning Events are watched, and each
    namespace's last read of them. All it needs of the operator it is given: how to queue a run, how to read a
    namespace's Warning Events, the clock and three settings (it knows no more of a run than its key and the status
    fields of its attempt)."""

    def __init__(
        self,
        enqueue: Callable[[Key], None],
        list_warnings: ListWarnings,
        settings: RecheckSettings,
        clock: Callable[[], datetime],
    ):
        self._enqueue, self._list_warnings, self._settings, self._clock = enqueue, list_warnings, settings, clock
        self.clear()
        #: namespace -> the last read of its Warning Events, shared by its runs
        self.warnings: dict[str, WarningsRead] = {}
        self._warnings_locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def clear(self) -> None:
        """Forget every due time and watched run (this replica stops acting: when it acts again, a sweep brings them
        back)."""
        self._due: dict[Key, float] = {}
        self._heap: list[tuple[float, Key]] = []
        #: namespace -> {run: its current attempt's job}: attempts Pending long enough to have their warnings read
        self.watching_warnings: dict[str, dict[Key, str]] = collections.defaultdict(dict)
        #: run -> the warnings about its job its last reconcile saw (a fingerprint)
        self.warnings_seen: dict[Key, int] = {}

    def at(self, key: Key, when: float) -> None:
        """Reconcile `key` at `when` (or earlier, if it is due earlier already: that reconcile says what comes next)."""
        current = self._due.get(key)
        if current is not None and current <= when:
            return
        self._due[key] = when
        heapq.heappush(self._heap, (when, key))

    def due(self, now: float) -> list[Key]:
        """The runs due by `now`, each once; they are no longer scheduled."""
        keys = []
        while self._heap and self._heap[0][0] <= now:
            when, key = heapq.heappop(self._heap)
            if self._due.get(key) == when:  # else superseded by an earlier time, or forgotten
                del self._due[key]
                keys.append(key)
        return keys

    def scheduled(self, key: Key) -> Optional[float]:
        return self._due.get(key)

    def watch_warnings(self, key: Key, job_name: Optional[str]) -> None:
        """Watch the Warning Events about `job_name` for `key` (None: stop watching)."""
        if job_name:
            self.watching_warnings[key[0]][key] = job_name
        else:
            self.watching_warnings.get(key[0], {}).pop(key, None)
            self.warnings_seen.pop(key, None)

    def forget(self, key: Key) -> None:
        self._due.pop(key, None)  # its heap entries are skipped when they come up
        self.watch_warnings(key, None)

    async def pending_warnings(self, key: Key, status: dict[str, Any]) -> list[dict[str, Any]]:
        """Warning Events about the current attempt's job and pods, once it has been Pending for a while; until then,
        a due time for when it has."""
        started = parse_time(status.get("attemptStartTime"))
        job_name = status.get("jobName")
        if status.get("phase") != "Pending" or not started or not job_name:
            self.watch_warnings(key, None)
            return []
        waited = (self._clock() - started).total_seconds()
        after = self._settings.pending_events_after_seconds
        if waited < after:
            self.at(key, time.monotonic() + after - waited)
            return []
        self.watch_warnings(key, job_name)
        warnings = [
            e
            for e in await self.namespace_warnings(key[0])
            if about_job((e.get("involvedObject") or {}).get("name") or "", job_name)
        ]
        self.warnings_seen[key] = fingerprint(warnings)
        return warnings

    async def namespace_warnings(self, namespace: str) -> list[dict[str, Any]]:
        """A namespace's Warning Events, read at most once per reconcile interval and shared by all its runs: one read
        per Pending run made a queue of 2,000 waiting runs send 2,000 LISTs per interval."""

        def fresh() -> Optional[WarningsRead]:
            read = self.warnings.get(namespace)
            return read if read and time.monotonic() - read.at < self._settings.reconcile_interval_seconds else None

        if (read := fresh()) is not None:
            return read.events
        async with self._warnings_locks[namespace]:  # runs that ask meanwhile wait for this read
            if (read := fresh()) is not None:
                return read.events
            try:
                events, complete = await self._list_warnings(namespace)
            except (ApiError, OSError, asyncio.TimeoutError) as error:
                log.warning("%s: could not read Warning Events: %s", namespace, error)
                events, complete = [], True
            if not complete and (namespace not in self.warnings or self.warnings[namespace].complete):  # once a spell
                log.warning(
                    "%s holds more than %d Warning Events: Pending runs there learn only of those among the first %d",
                    namespace,
                    WARNING_EVENTS_READ,
                    WARNING_EVENTS_READ,
                )
            self.warnings[namespace] = WarningsRead(
                time.monotonic(),
                [
                    {
                        "reason": _short(e.get("reason"), 128),
                        "message": _short(e.get("message"), 1024),  # as client-go's event recorder cuts them
                        "involvedObject": {
                            k: _short(_mapping(e.get("involvedObject")).get(k), 253) for k in ("kind", "name")
                        },
                    }
                    for e in events
                ],
                complete,
            )
            return self.warnings[namespace].events

    async def wake_on_warnings(self) -> None:
        """Read each watched namespace's Warning Events, and queue the runs whose job's warnings changed."""
        for namespace, watched in list(self.watching_warnings.items()):
            if not watched:
                self.watching_warnings.pop(namespace, None)
                continue
            events = await self.namespace_warnings(namespace)
            runs = {job_name: key for key, job_name in watched.items()}
            about: dict[Key, list[dict[str, Any]]] = collections.defaultdict(list)
            for event in events:  # about_job for every watched job at once
                for job_name in jobs_it_may_be_about(event["involvedObject"].get("name") or ""):
                    if (key := runs.get(job_name)) is not None:
                        about[key].append(event)
            for key in list(watched):
                if fingerprint(about.get(key, [])) != self.warnings_seen.get(key):
                    self._enqueue(key)

    async def run(self, acting: Callable[[], bool], runs: Callable[[], Iterable[Key]]) -> None:
        """The rechecks, for ever: due runs at every tick, warnings once per reconcile interval, a full sweep of
        `runs` every resync_seconds and whenever this replica starts `acting` (it has seen the runs and leads)."""
        tick = min(1.0, self._settings.reconcile_interval_seconds)
        next_warnings = next_sweep = time.monotonic()
        was_acting = False
        while True:
            await asyncio.sleep(tick)
            if not acting():
                was_acting = False
                continue
            now = time.monotonic()
            if not was_acting or now >= next_sweep:
                was_acting, next_sweep = True, now + self._settings.resync_seconds
                for key in list(runs()):
                    self._enqueue(key)
            for key in self.due(now):
                self._enqueue(key)
            if now >= next_warnings:
                next_warnings = now + self._settings.reconcile_interval_seconds
                await self.wake_on_warnings()


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _short(value: Any, most: int) -> Optional[str]:
    """A string field of an Event anyone in the namespace may have written, cut to `most` characters (None if not a
    string): these are held until the next read and shown in runs' conditions."""
    return value[:most] if isinstance(value, str) else None
