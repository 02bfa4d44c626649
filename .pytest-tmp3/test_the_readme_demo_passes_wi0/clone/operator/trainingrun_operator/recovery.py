"""The recovery policy: what happens after an attempt ends, for the operator (`reconcile.decide`) and
`trainingrun local` alike. Pure: the run's spec.recovery, the restarts so far and why the attempt ended in;
the decision out (stop or retry, the counts after this end, the wait before the next attempt)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from trainingrun_api.exit_codes import PERMANENT, PREEMPTION

from . import api


@dataclass(frozen=True)
class Restarts:
    """Attempts lost so far, by cause (status.restarts)."""

    failures: int = 0
    preemptions: int = 0

    @property
    def total(self) -> int:
        return self.failures + self.preemptions

    @classmethod
    def from_status(cls, restarts: Optional[dict[str, Any]]) -> "Restarts":
        restarts = restarts or {}
        return cls(int(restarts.get("failures") or 0), int(restarts.get("preemptions") or 0))

    def as_status(self) -> dict[str, int]:
        return {"failures": self.failures, "preemptions": self.preemptions, "total": self.total}


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt that did not succeed."""

    retry: bool
    restarts: Restarts  #: counted with this end (unchanged after a permanent error)
    counter: str = ""  #: "failures" or "preemptions": the budget this end is charged to
    budget: int = 0  #: that budget's spec.recovery value
    delay_seconds: int = 0  #: before the next attempt, when retrying
    stop_reason: str = ""  #: PermanentError, FailureBudgetSpent or PreemptionBudgetSpent, when not retrying

    @property
    def budget_field(self) -> str:
        """The spec.recovery field of the budget: maxFailures or maxPreemptions."""
        return {"failures": "maxFailures", "preemptions": "maxPreemptions"}.get(self.counter, "")

    @property
    def used(self) -> int:
        return getattr(self.restarts, self.counter) if self.counter else 0

    def budget_words(self) -> str:
        """ "spec.recovery.maxFailures=3 is spent (4 failures); raise it to allow more"."""
        return (
            f"spec.recovery.{self.budget_field}={self.budget} is spent ({self.used} {self.counter}); "
            "raise it to allow more"
        )


def backoff_seconds(recovery: api.Recovery, restarts_so_far: int) -> int:
    """Exponential from spec.recovery.backoffSeconds, capped at maxBackoffSeconds."""
    return int(min(recovery.backoff_seconds * 2 ** max(0, restarts_so_far - 1), recovery.max_backoff_seconds))


def after_attempt(recovery: api.Recovery, restarts: Restarts, cause: str) -> Decision:
    """An attempt ended for `cause` (exit_codes' permanent, preemption or failure): retry, or stop and why."""
    if cause == PERMANENT:
        return Decision(retry=False, restarts=restarts, stop_reason="PermanentError")
    if cause == PREEMPTION:
        counted = Restarts(restarts.failures, restarts.preemptions + 1)
        counter, budget = "preemptions", recovery.max_preemptions
    else:
        counted = Restarts(restarts.failures + 1, restarts.preemptions)
        counter, budget = "failures", recovery.max_failures
    spent = getattr(counted, counter) > budget
    return Decision(
        retry=not spent,
        restarts=counted,
        counter=counter,
        budget=budget,
        delay_seconds=0 if spent else backoff_seconds(recovery, counted.total),
        stop_reason=("PreemptionBudgetSpent" if cause == PREEMPTION else "FailureBudgetSpent") if spent else "",
    )
