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
import logging
import time
from typing import Any, Optional

from trainingrun_api.contract import parse_time

from ..state import Key, OperatorState, WarningsRead
from .kube import ApiError

log = logging.getLogger("trainingrun.operator")


def jobs_it_may_be_about(name: str) -> set[str]:
    """The job names an Event about object `name` may be about: the job itself, or its pods (<job>-worker-<i>), so
    `name` or a part of it before a '-'."""
    return {name[:cut] for cut in [len(name), *(i for i, c in enumerate(name) if c == "-")]}


def about_job(name: str, job_name: str) -> bool:
    return job_name in jobs_it_may_be_about(name)


def fingerprint(warnings: list[dict[str, Any]]) -> int:
    return hash(tuple((w.get("reason"), w.get("message"), w["involvedObject"].get("name")) for w in warnings))


async def pending_warnings(state: OperatorState, key: Key, status: dict[str, Any]) -> list[dict[str, Any]]:
    """Warning Events about the current attempt's job and pods, once it has been Pending for a while; until then,
    a due time for when it has."""
    started = parse_time(status.get("attemptStartTime"))
    job_name = status.get("jobName")
    if status.get("phase") != "Pending" or not started or not job_name:
        state.rechecks.watch_warnings(key, None)
        return []
    waited = (state.clock() - started).total_seconds()
    if waited < state.settings.pending_events_after_seconds:
        state.rechecks.at(key, time.monotonic() + state.settings.pending_events_after_seconds - waited)
        return []
    state.rechecks.watch_warnings(key, job_name)
    warnings = [
        e
        for e in await namespace_warnings(state, key[0])
        if about_job((e.get("involvedObject") or {}).get("name") or "", job_name)
    ]
    state.rechecks.warnings_seen[key] = fingerprint(warnings)
    return warnings


#: The most Warning Events read from one namespace at a time (500 a request): Events live an hour, so a namespace holds
#: more only while something fails at a high rate, and each read is held in memory until the next.
WARNING_EVENTS_READ = 2000


async def namespace_warnings(state: OperatorState, namespace: str) -> list[dict[str, Any]]:
    """A namespace's Warning Events, read at most once per reconcile interval and shared by all its runs: one read
    per Pending run made a queue of 2,000 waiting runs send 2,000 LISTs per interval."""

    def fresh() -> Optional[WarningsRead]:
        read = state.warnings.get(namespace)
        return read if read and time.monotonic() - read.at < state.settings.reconcile_interval_seconds else None

    if (read := fresh()) is not None:
        return read.events
    async with state.warnings_locks[namespace]:  # runs that ask meanwhile wait for this read
        if (read := fresh()) is not None:
            return read.events
        try:
            events, complete = await state.client().list(
                "v1", "Event", namespace, most=WARNING_EVENTS_READ, fieldSelector="type=Warning"
            )
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning("%s: could not read Warning Events: %s", namespace, error)
            events, complete = [], True
        if not complete and (namespace not in state.warnings or state.warnings[namespace].complete):  # once a spell
            log.warning(
                "%s holds more than %d Warning Events: Pending runs there learn only of those among the first %d",
                namespace,
                WARNING_EVENTS_READ,
                WARNING_EVENTS_READ,
            )
        state.warnings[namespace] = WarningsRead(
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
        return state.warnings[namespace].events


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _short(value: Any, most: int) -> Optional[str]:
    """A string field of an Event anyone in the namespace may have written, cut to `most` characters (None if not a
    string): these are held until the next read and shown in runs' conditions."""
    return value[:most] if isinstance(value, str) else None


async def _wake_on_warnings(state: OperatorState) -> None:
    """Read each watched namespace's Warning Events, and queue the runs whose job's warnings changed."""
    for namespace, watched in list(state.rechecks.watching_warnings.items()):
        if not watched:
            state.rechecks.watching_warnings.pop(namespace, None)
            continue
        events = await namespace_warnings(state, namespace)
        runs = {job_name: key for key, job_name in watched.items()}
        about: dict[Key, list[dict[str, Any]]] = collections.defaultdict(list)
        for event in events:  # about_job for every watched job at once
            for job_name in jobs_it_may_be_about(event["involvedObject"].get("name") or ""):
                if (key := runs.get(job_name)) is not None:
                    about[key].append(event)
        for key in list(watched):
            if fingerprint(about.get(key, [])) != state.rechecks.warnings_seen.get(key):
                state.enqueue(key)


async def run(state: OperatorState) -> None:
    """The rechecks, for ever: due runs at every tick, warnings once per reconcile interval, a full sweep every
    resync_seconds and whenever this replica starts acting."""
    settings = state.settings
    tick = min(1.0, settings.reconcile_interval_seconds)
    next_warnings = next_sweep = time.monotonic()
    was_acting = False
    while True:
        await asyncio.sleep(tick)
        if state.indexes is None or not state.acting.is_set():
            was_acting = False
            continue  # no run seen yet, or another replica acts
        now = time.monotonic()
        if not was_acting or now >= next_sweep:
            was_acting, next_sweep = True, now + settings.resync_seconds
            for key in list(state.runs):
                state.enqueue(key)
        for key in state.rechecks.due(now):
            state.enqueue(key)
        if now >= next_warnings:
            next_warnings = now + settings.reconcile_interval_seconds
            await _wake_on_warnings(state)
