"""Figures derived from a run's reports, the same for the operator's status, the trainer's metrics and `trainingrun
local`: progress with percent done and an estimated completion time, goodput, and where the wall time went."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Optional

from .contract import parse_time, rfc3339
from .progress_report import ProcessTime


def with_estimates(previous: Optional[dict[str, Any]], progress: dict[str, Any]) -> dict[str, Any]:
    """`progress` (a status.progress dict) with percent done and the estimated completion time, from the step rate
    between the previous progress and this one: the operator's report endpoint and `trainingrun local` both. Without a rate (the first report, a resume below the previous step)
    the previous estimate is kept while the step stands, else there is none."""
    step, total = progress.get("step"), progress.get("totalSteps")
    if step is None or not total:
        return progress
    estimated = {**progress, "percent": round(100.0 * min(step, total) / total, 1)}
    now, before = parse_time(progress.get("updatedAt")), previous or {}
    then = parse_time(before.get("updatedAt"))
    if step >= total:
        estimated["estimatedCompletionTime"] = progress.get("updatedAt")
    elif now and then and isinstance(before.get("step"), int) and step > before["step"] and now > then:
        rate = (step - before["step"]) / (now - then).total_seconds()
        estimated["estimatedCompletionTime"] = _estimate(now, (total - step) / rate)
    elif step == before.get("step") and before.get("estimatedCompletionTime"):
        estimated["estimatedCompletionTime"] = before["estimatedCompletionTime"]
    elif before.get("estimatedCompletionTime"):
        estimated["estimatedCompletionTime"] = None  # a merge patch removes the stale one
    return estimated


#: An estimate further away than this is no estimate (a report may say any totalSteps up to 2**63).
MAX_ESTIMATE_SECONDS = 100 * 365 * 86400


def _estimate(now: datetime, seconds_left: float) -> Optional[str]:
    """When a run `seconds_left` from `now` completes; None past MAX_ESTIMATE_SECONDS (datetime ends at year 9999)."""
    if not seconds_left <= MAX_ESTIMATE_SECONDS:
        return None
    return rfc3339(now + timedelta(seconds=seconds_left))


def goodput(productive_seconds: float, wall_seconds: float) -> Optional[float]:
    """The one definition of goodput, for status, the trainer's metric and `trainingrun local`: step time kept in
    the model (progress.productiveSeconds: lost steps are not in it) / wall time since the run started (every
    attempt, restart and wait included). None before any wall time has passed."""
    if wall_seconds <= 0:
        return None
    return min(1.0, max(0.0, productive_seconds) / wall_seconds)


#: The goodput breakdown's parts, in the order they are shown; they add up to wall time.
BREAKDOWN = ("productive", "lost", "startup", "restore", "checkpoint", "data_wait", "eval", "hang", "backoff", "other")


def time_breakdown(
    wall_seconds: float, processes: list[ProcessTime], productive_seconds: float, backoff_seconds: float = 0.0
) -> dict[str, float]:
    """Where `wall_seconds` went, from the last report of each training process in that time (rank 0's), the run's
    productive seconds at its end and the time spent waiting out backoffs: {part: seconds} over BREAKDOWN.

    productive: step compute the model kept since the first process resumed; lost: step compute that a crash or a
    rollback threw away; startup: starting (and ending) processes, imports, rendezvous, model and data, and all time
    no training process reported (launchers, a killed process after its last report); restore, checkpoint (the
    training thread blocked, and the time a background save added to the steps beside it), data_wait, eval: as the
    processes measured them; hang: from a hung process's last step to the diagnosis (the restart after it is
    startup); other: what remains (logging, metrics, reporting between steps)."""

    def total(field: str) -> float:
        return float(sum(getattr(process, field) for process in processes))

    start = min((process.restored_productive_seconds for process in processes), default=productive_seconds)
    compute = total("compute_seconds")
    kept = min(compute, max(0.0, productive_seconds - start))
    parts = {
        "productive": kept,
        "lost": compute - kept,
        "startup": total("startup_seconds") + max(0.0, wall_seconds - backoff_seconds - total("alive_seconds")),
        "restore": total("restore_seconds"),
        "checkpoint": total("checkpoint_seconds"),
        "data_wait": total("data_wait_seconds"),
        "eval": total("eval_seconds"),
        "hang": total("hang_seconds"),
        "backoff": backoff_seconds,
    }
    parts["other"] = wall_seconds - sum(parts.values())
    return parts
