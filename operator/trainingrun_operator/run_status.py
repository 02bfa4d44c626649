"""Edits to a run's status that do not decide anything: its conditions (one per type, a transition time that
changes only with the status; the spec's own: rejected, change pending), goodput, and the accounting of wall time into productive, lost and waiting parts
from the processes' reports. Pure: the time is an argument."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from pydantic import ValidationError

from trainingrun_api import contract, progress_report, run_figures

from . import api, api_status, builders, naming
from .builders import Note

parse_time = contract.parse_time
TERMINAL = ("Succeeded", "Failed")


def goodput(status: dict[str, Any]) -> Optional[float]:
    """Productive step time the trainer reports / wall time from start to that report.

    Measured to the report's own time, not to now, so it is a function of status alone: writing it
    never changes it, and a restarted operator computes the same figure.
    """
    progress = status.get("progress") or {}
    started, reported = parse_time(status.get("startTime")), parse_time(progress.get("updatedAt"))
    productive = progress.get("productiveSeconds")
    if productive is None or not started or not reported:
        return None
    figure = run_figures.goodput(productive, (reported - started).total_seconds())
    return None if figure is None else round(figure, 4)


def account_time(
    status: dict[str, Any], times: progress_report.ProcessTime, productive_seconds: Optional[float], now: datetime
) -> dict[str, Any]:
    """status.processTime and status.timeBreakdown after a report of `times` at `now`: a process other than the one
    that reported last adds that one's last report to the ended processes; the breakdown covers startTime to now."""
    account = status.get("processTime") or {}
    ended = progress_report.ProcessTime.from_wire(account["ended"]) if account.get("ended") else None
    previous = account.get("current")
    if previous and previous.get("process") != times.process:
        last = progress_report.ProcessTime.from_wire(previous)
        ended = ended.plus(last) if ended else last.model_copy(update={"process": "ended"})
    processes = [p for p in (ended, times) if p is not None]
    started = parse_time(status.get("startTime"))
    wall = (now - started).total_seconds() if started else sum(p.alive_seconds for p in processes)
    backoff = float((status.get("restarts") or {}).get("backoffSeconds") or 0.0)
    if productive_seconds is None:
        productive_seconds = float((status.get("progress") or {}).get("productiveSeconds") or 0.0)
    parts = run_figures.time_breakdown(max(0.0, wall), processes, productive_seconds, backoff)
    breakdown = api_status.TimeBreakdown(
        wall_seconds=round(max(0.0, wall), 3),
        **{f"{part}_seconds": round(seconds, 3) for part, seconds in parts.items()},
    )
    return {
        "processTime": {"ended": ended.to_wire() if ended else None, "current": times.to_wire()},
        "timeBreakdown": breakdown.to_wire(),
    }


class Conditions:
    """Edits to status.conditions: one per type; a transition time changes only with the status."""

    def __init__(self, current: list[dict[str, Any]], now: str, generation: Optional[int]):
        self.items = {c["type"]: dict(c) for c in current if c.get("type")}
        self.now, self.generation, self.changed = now, generation, False

    def is_true(self, type_: str) -> bool:
        return self.items.get(type_, {}).get("status") == "True"

    def set(self, type_: str, true: bool, reason: str, message: str = "") -> bool:
        """Set a condition; returns whether its status flipped (worth an Event)."""
        old = self.items.get(type_)
        status = "True" if true else "False"
        if old is None and not true:
            return False  # a condition that never was True needs no False entry
        flipped = old is None or old.get("status") != status
        new = {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": self.now if old is None or flipped else old.get("lastTransitionTime", self.now),
        }
        if self.generation is not None:
            new["observedGeneration"] = self.generation
        if new != old:
            self.items[type_], self.changed = new, True
        return flipped

    def as_list(self) -> list[dict[str, Any]]:
        return list(self.items.values())


def spec_conditions(
    run: api.TrainingRun,
    status: dict[str, Any],
    job: Optional[dict[str, Any]],
    started_uri: str,
    conditions: Conditions,
) -> list[Note]:
    """SpecRejected and SpecChangePending, with an Event each time one turns true: immutable fields are refused;
    other changes wait for the next attempt, and say so."""
    notes: list[Note] = []
    wanted_uri = run.spec.checkpoint.uri
    if wanted_uri != started_uri:
        message = (
            f"spec.checkpoint.uri cannot change once the run has started (it is {started_uri}): "
            "set it back, or create a new TrainingRun to train elsewhere"
        )
        if conditions.set("SpecRejected", True, "CheckpointUriImmutable", message):
            notes.append(Note("Warning", "SpecRejected", message))
    elif conditions.is_true("SpecRejected"):
        conditions.set("SpecRejected", False, "Accepted", "the spec is accepted")
    if job is None or status.get("phase") in TERMINAL:
        return notes
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    if run.metadata.generation is not None and annotations.get(naming.ANNOTATION_GENERATION) == str(
        run.metadata.generation
    ):
        return notes  # built from this very spec
    if naming.ANNOTATION_SPEC_DIGEST in annotations:
        built_from, digest = annotations[naming.ANNOTATION_SPEC_DIGEST], naming.spec_digest
    else:  # an older operator's job
        built_from, digest = annotations.get(naming.ANNOTATION_SPEC_HASH), naming.legacy_spec_hash
    if built_from and built_from != digest(builders.as_started(run, started_uri)):
        attempt = int(status.get("attempt") or 0)
        message = (
            f"the spec changed; attempt {attempt} keeps running as it was built, "
            f"the change applies from attempt {attempt + 1} (suspend and resume the run to apply it now)"
        )
        if conditions.set("SpecChangePending", True, "AppliesOnNextAttempt", message):
            notes.append(Note("Normal", "SpecChangePending", message))
    return notes


def hang_conditions(status: dict[str, Any], conditions: Conditions) -> list[Note]:
    """Hung from the last hang a rank diagnosed (status.lastHang): true, with a Warning Event naming the collective
    and the ranks that held the run up, until the run trains past the step it hung after; then false."""
    hang = status.get("lastHang") or {}
    if not hang:
        return []
    step = (status.get("progress") or {}).get("step")
    if step is None or step <= hang.get("step", 0):
        message = f"{hang.get('diagnosis', 'a hang')} (diagnosed {hang.get('time', '')}; the worker group restarts)"
        if conditions.set("Hung", True, "NoProgress", message):
            return [Note("Warning", "Hung", message)]
    elif conditions.is_true("Hung"):
        conditions.set("Hung", False, "TrainingAgain", f"trained past the hang after step {hang.get('step')}")
    return []


def slow_rank_conditions(status: dict[str, Any], conditions: Conditions) -> list[Note]:
    """SlowRank from the straggler rank 0 last named (status.slowRank): true, with a Warning Event naming the rank, its
    pod and node and how much slower it is, while one is named; false once rank 0 says none is."""
    slow = status.get("slowRank") or {}
    if not slow:
        return []
    try:
        words = progress_report.SlowRank.model_validate(slow, by_alias=True).words()
    except ValidationError:  # status is written by this operator only; a hand edit is not worth a crash
        words = "a rank is slower than the others"
    if slow.get("rank") is not None:
        if conditions.set("SlowRank", True, "SlowerThanOthers", words):
            return [Note("Warning", "SlowRank", words)]
    elif conditions.is_true("SlowRank"):
        conditions.set("SlowRank", False, "NoneSlow", words)
    return []


def memory_conditions(status: dict[str, Any], conditions: Conditions) -> list[Note]:
    """CheckpointMemoryShort from what rank 0 last reported (status.checkpointMemoryShort): true, with a Warning Event,
    while some pods' memory has no room for the checkpoint, naming them and the fix; false once every pod holds one."""
    short = status.get("checkpointMemoryShort") or {}
    pods, step = short.get("pods") or [], short.get("step")
    if pods:
        message = (
            f"checkpoint step {step} did not fit in the memory (/dev/shm) of {', '.join(pods)}: restarts there read it "
            "from storage, and with several pods checkpoints commit to storage, at its pace; raise "
            "spec.resources.sharedMemory (about one copy of the model and optimizer state per pod, plus 10%)"
        )
        if conditions.set("CheckpointMemoryShort", True, "SharedMemoryTooSmall", message):
            return [Note("Warning", "CheckpointMemoryShort", message)]
    elif conditions.is_true("CheckpointMemoryShort"):
        fits = f"checkpoint step {step} fits" if step is not None else "a new attempt's checkpoints are kept"
        conditions.set("CheckpointMemoryShort", False, "Fits", f"{fits} in every pod's memory")
    return []
