"""What to do for one TrainingRun, decided from what is observed. Pure: no API calls, no clock.

`decide(Observed) -> Plan` is the whole operator logic: which attempt should exist, how a failed
attempt is classified and charged, when the next one starts, what the status and conditions say
and which Events tell the story. The kopf handlers (handlers.py) only gather the observation from
kopf's in-memory indexes and carry the plan out, so every decision here is unit-tested without a
cluster, and a restarted operator decides the same from the same status.

Everything the operator must remember lives in `status`: attempt, jobName, restarts by cause,
nextAttemptTime while Recovering, startTime for goodput and the checkpoint URI the run started with.

What the children say (a job's state, why an attempt failed, what keeps pods from running) is read by
children.py, status edits that decide nothing (conditions, goodput, time accounting) are run_status.py's, and the
recovery policy is recovery.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Optional

from trainingrun_api import contract

from . import api, kube_shapes, naming, recovery
from .backends import PYTORCHJOB, Backend
from .builders import Note
from .children import (
    BLOCKED_CONDITIONS,
    Failure,
    attempt_of,
    blocked_pods,
    classify_failure,
    failed_since,
    missing_secret,
    missing_secret_volume,
    pods_of,
)
from .run_status import (
    TERMINAL,
    Conditions,
    goodput,
    hang_conditions,
    memory_conditions,
    slow_rank_conditions,
    spec_conditions,
)

#: How long a failed job whose pods show no reason yet is given for the pod watch to catch up
#: (the job and pod watches are separate streams); after that it is classified as a failure.
FAILURE_EVIDENCE_GRACE = timedelta(seconds=30)


@dataclass
class Observed:
    """One run and its children as the operator sees them now."""

    run: api.TrainingRun
    status: dict[str, Any]  #: wire form (camelCase)
    jobs: dict[str, dict[str, Any]]  #: this run's jobs (PyTorchJobs or JobSets) by name
    pods: list[dict[str, Any]]  #: this run's pods, every attempt
    now: datetime
    keep_failed_attempts: int = 1  #: failed attempts whose job (and pods, for logs) stay until the run ends
    backend: Backend = PYTORCHJOB  #: what the run's attempts are (backends.Choice.of)
    #: The objects between the current attempt's job and its pods (a JobSet's Jobs), controlled by that job.
    parts: list[dict[str, Any]] = field(default_factory=list)
    #: Warning Events about the current attempt's job and pods (reason, message, involvedObject), read only while
    #: an attempt has been Pending for a while: they are how pods that are never created, never scheduled or
    #: never started show (Kubeflow's or the Job controller's FailedCreate, the kubelet's FailedMount).
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Plan:
    status: dict[str, Any] = field(default_factory=dict)  #: merge patch for status
    start_attempt: Optional[int] = None  #: create (or adopt) the children of this attempt
    resume_from: Optional[str] = None  #: TRAININGRUN_RESUME_FROM of that attempt
    avoid_nodes: list[str] = field(default_factory=list)  #: nodes that attempt's pods must not run on (avoidedNodes)
    #: Nodes newly named in two hangs in a row: cordoned where the chart allows it (operator.cordonAvoidedNodes).
    cordon_nodes: list[str] = field(default_factory=list)
    checkpoint_uri: str = ""  #: the URI attempts use (the one the run started with); `decide` always sets it
    suspend_job: Optional[str] = None
    delete_jobs: list[str] = field(default_factory=list)
    events: list[Note] = field(default_factory=list)
    restart_cause: Optional[str] = None  #: failure, preemption or stall, when an attempt ended here (metrics)
    attempt_cause: Optional[str] = None  #: initial, recovery, resume or recreate, when an attempt starts (metrics)
    backend: Backend = PYTORCHJOB  #: what the attempt's objects are (Observed.backend)
    #: When this decision changes with the clock alone (a backoff ends, a stall timeout): reconcile then (rechecks.py);
    #: now when the next step is due at once. None: only an event changes it. Never a time already acted on.
    recheck_at: Optional[datetime] = None

    def recheck(self, at: datetime) -> None:
        self.recheck_at = at if self.recheck_at is None else min(self.recheck_at, at)


# ---------------------------------------------------------------- small pure helpers


rfc3339, parse_time = contract.rfc3339, contract.parse_time  # the one pair of time helpers, used here often


# ---------------------------------------------------------------- the decision


def decide(o: Observed) -> Plan:
    plan = Plan(backend=o.backend)
    status, spec = o.status, o.run.spec
    phase, attempt = status.get("phase"), int(status.get("attempt") or 0)
    now = rfc3339(o.now)
    generation = o.run.metadata.generation
    conditions = Conditions(status.get("conditions") or [], now, generation)
    plan.checkpoint_uri = status.get("checkpointUri") or spec.checkpoint.uri

    if phase in TERMINAL:
        plan.delete_jobs = _old_jobs(o, keep_after=attempt - 1, keep=0)
        return plan

    if phase is None:
        _start(plan, o, 1, "initial", conditions, resume_from=None)
        plan.status.update(startTime=now, checkpointUri=spec.checkpoint.uri, backend=o.backend.kind)
        if spec.suspend:
            plan.status["phase"] = "Suspended"
        return _finish(plan, o, conditions)

    job_name = status.get("jobName") or naming.job_name(o.run.metadata.name, attempt)
    job = o.jobs.get(job_name)
    pods = pods_of(o.pods, job_name, attempt)
    plan.events += spec_conditions(o.run, o.status, job, plan.checkpoint_uri, conditions)
    plan.events += memory_conditions(o.status, conditions)
    plan.events += hang_conditions(o.status, conditions)
    plan.events += slow_rank_conditions(o.status, conditions)

    if spec.suspend:
        if phase != "Suspended":
            # A job not seen yet is not absent: one created a moment ago (the watch not there yet) must stop too.
            if job is None or o.backend.state(job, pods) not in TERMINAL:
                plan.suspend_job = job_name
            plan.status["phase"] = "Suspended"
            plan.events.append(
                Note(
                    "Normal",
                    "Suspended",
                    f"attempt {attempt} suspended: its pods stop after an "
                    "emergency checkpoint; set spec.suspend to false to resume",
                )
            )
        return _finish(plan, o, conditions)

    if phase == "Suspended":
        if _old_pods_still_stopping(plan, o, attempt, job_name, conditions):
            return _finish(plan, o, conditions)
        plan.delete_jobs.append(job_name)
        _start(plan, o, attempt + 1, "resume", conditions, resume_from=_last_good(status))
        return _finish(plan, o, conditions)

    if phase == "Recovering":
        due = parse_time(status.get("nextAttemptTime"))
        if due is None or o.now >= due:
            _start(plan, o, attempt + 1, "recovery", conditions, resume_from=_last_good(status))
        else:
            plan.recheck(due)
        return _finish(plan, o, conditions)

    # Pending or Running: follow the current attempt.
    if job is None:
        # Created but not seen yet, or removed by someone: (re)create it; an existing one is adopted.
        plan.start_attempt, plan.resume_from, plan.attempt_cause = attempt, _last_good(status), "recreate"
        return _finish(plan, o, conditions)

    secret = missing_secret(pods, spec.secrets.secret_names()) or (
        missing_secret_volume(o.warnings) if phase == "Pending" else None
    )
    if secret:
        if conditions.set("SecretMissing", True, "CreateContainerConfigError", secret):
            plan.events.append(
                Note(
                    "Warning",
                    "SecretMissing",
                    f"{secret}; create it in namespace "
                    f"{o.run.metadata.namespace} (no restart is charged while waiting)",
                )
            )
    elif conditions.is_true("SecretMissing"):
        conditions.set("SecretMissing", False, "SecretsFound", "all referenced Secrets and keys exist")
        plan.events.append(Note("Normal", "SecretsFound", "the missing Secret is there now; the pods are starting"))

    state = o.backend.state(job, pods)
    # Also while Running: a pod replaced within the attempt (deleted, evicted, its node gone) can find no node.
    blocked = blocked_pods(job, pods, o.warnings) if state not in TERMINAL else {}
    for type_ in BLOCKED_CONDITIONS:
        if type_ in blocked:
            reason, message = blocked[type_]
            if conditions.set(type_, True, reason, message[:1000]):
                plan.events.append(Note("Warning", type_, f"attempt {attempt}: {message}"[:1000]))
        elif conditions.is_true(type_):
            conditions.set(type_, False, "Resolved", "no longer seen")
    if state == "Succeeded":
        step = (status.get("progress") or {}).get("step")
        plan.status.update(phase="Succeeded", completionTime=now)
        conditions.set("Complete", True, "Succeeded", f"finished in attempt {attempt}")
        plan.events.append(
            Note(
                "Normal",
                "Succeeded",
                f"training finished in attempt {attempt}" + (f" at step {step}" if step is not None else ""),
            )
        )
        plan.delete_jobs = _old_jobs(o, keep_after=attempt - 1, keep=0)
    elif state == "Failed":
        failure = classify_failure(job, pods)
        since = failed_since(job)
        if not failure.from_pods and since and o.now < since + FAILURE_EVIDENCE_GRACE:
            plan.recheck(since + FAILURE_EVIDENCE_GRACE)
            return _finish(plan, o, conditions)  # the pods' story is probably on its way: decide then
        _attempt_ended(plan, o, attempt, failure, conditions)
    else:
        _count_in_place_restart(plan, o, attempt, job)
        if state == "Running" and phase == "Pending":
            plan.status["phase"] = "Running"
            plan.events.append(Note("Normal", "Running", f"attempt {attempt} is running ({o.backend.names(job_name)})"))
        if _hung_twice_on_a_node(plan, o, attempt, job_name, conditions):
            return _finish(plan, o, conditions)
        if (plan.status.get("phase") or phase) == "Running" and not blocked:
            # Waiting for a node is not a stall: a new attempt would wait for the same node, charged as a failure.
            _check_stall(plan, o, attempt, job_name, conditions)
    return _finish(plan, o, conditions)


#: After a suspended run's old pods' grace period, how much longer a resume waits for them to be gone.
OLD_PODS_SLACK = timedelta(seconds=30)


def _old_pods_still_stopping(plan: Plan, o: Observed, attempt: int, job_name: str, conditions: Conditions) -> bool:
    """Whether a resume waits: the suspended attempt's pods may still be writing their emergency checkpoint, and a
    new attempt that started now would resume from the checkpoint before it and save and rotate the same prefix at
    the same time. It waits until they are gone, for at most their grace period and OLD_PODS_SLACK."""
    stopping = [
        p
        for p in pods_of(o.pods, job_name, attempt)
        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]
    waiting = conditions.items.get("WaitingForOldPods", {}) if conditions.is_true("WaitingForOldPods") else {}
    since = waiting.get("lastTransitionTime")
    limit = timedelta(seconds=o.run.spec.termination_grace_period_seconds) + OLD_PODS_SLACK
    waited_out = since is not None and o.now >= (parse_time(since) or o.now) + limit
    if stopping and not waited_out:
        plan.recheck(((parse_time(since) if since else None) or o.now) + limit)
        message = (
            f"attempt {attempt}'s {len(stopping)} pod(s) still stop (their emergency checkpoint); attempt "
            f"{attempt + 1} starts when they are gone, or after {int(limit.total_seconds())} s"
        )
        if conditions.set("WaitingForOldPods", True, "OldPodsStopping", message):
            plan.events.append(Note("Normal", "WaitingForOldPods", message))
        return True
    if conditions.is_true("WaitingForOldPods"):
        conditions.set(
            "WaitingForOldPods",
            False,
            "OldPodsGone" if not stopping else "WaitedLongEnough",
            "the suspended attempt's pods are gone"
            if not stopping
            else f"attempt {attempt}'s pods outlived their grace period; attempt {attempt + 1} starts anyway",
        )
    return False


def _last_good(status: dict[str, Any]) -> Optional[str]:
    return (status.get("lastGoodCheckpoint") or {}).get("uri")


def _old_jobs(o: Observed, keep_after: int, keep: int) -> list[str]:
    """This run's jobs of attempts up to `keep_after`, except the newest `keep` of them."""
    old = sorted((attempt_of(j) or 0, name) for name, j in o.jobs.items() if (attempt_of(j) or 0) <= keep_after)
    return [name for _, name in old[: max(0, len(old) - keep)]]


def _start(
    plan: Plan, o: Observed, number: int, cause: str, conditions: Conditions, resume_from: Optional[str]
) -> None:
    name = naming.job_name(o.run.metadata.name, number)
    plan.start_attempt, plan.resume_from, plan.attempt_cause = number, resume_from, cause
    plan.avoid_nodes = list(plan.status.get("avoidedNodes", o.status.get("avoidedNodes")) or [])
    plan.status.update(
        phase="Pending",
        attempt=number,
        jobName=name,
        attemptStartTime=rfc3339(o.now),
        nextAttemptTime=None,
        checkpointInMemory=None,
        checkpointMemoryShort=None,
        slowRank=None,
    )
    if _restarts(o.status).get("attemptPodsFailed") is not None:  # counted for the attempt that ended
        plan.status["restarts"] = {**_restarts(o.status), "attemptPodsFailed": None}
    if conditions.is_true("SpecChangePending"):
        conditions.set("SpecChangePending", False, "Applied", f"attempt {number} runs the current spec")
    where = f"resuming from {resume_from}" if resume_from else "from the start"
    plan.events.append(Note("Normal", "AttemptStarted", f"attempt {number} started ({o.backend.names(name)}), {where}"))
    plan.delete_jobs += _old_jobs(o, keep_after=number - 1, keep=o.keep_failed_attempts)


def _attempt_ended(
    plan: Plan, o: Observed, attempt: int, failure: Failure, conditions: Conditions, stalled: bool = False
) -> None:
    status = o.status
    decision = recovery.after_attempt(
        o.run.spec.recovery, recovery.Restarts.from_status(status.get("restarts")), failure.cause
    )
    if decision.stop_reason == "PermanentError":
        message = f"attempt {attempt}: {failure.detail}; retrying cannot help, fix the cause and create the run again"
        _fail(plan, o, "PermanentError", message, conditions)
        return
    restarts = _restarts(status)  # with the in-place counts, which this end does not change
    restarts.update(decision.restarts.as_status())
    plan.status["restarts"] = restarts
    plan.restart_cause = "stall" if stalled else failure.cause
    if not decision.retry:
        _fail(
            plan, o, decision.stop_reason, f"attempt {attempt}: {failure.detail}; {decision.budget_words()}", conditions
        )
        return
    delay = decision.delay_seconds
    restarts["backoffSeconds"] = round(float(restarts.get("backoffSeconds") or 0.0) + delay, 3)
    plan.status.update(phase="Recovering", nextAttemptTime=rfc3339(o.now + timedelta(seconds=delay)))
    plan.recheck(o.now + timedelta(seconds=delay))  # now, with no backoff: the next reconcile starts it
    resume = _last_good(status)
    plan.events.append(
        Note(
            "Warning",
            "AttemptPreempted" if failure.cause == "preemption" else "AttemptFailed",
            f"attempt {attempt}: {failure.detail}; {decision.counter} {decision.used}/{decision.budget}; attempt "
            f"{attempt + 1} starts in {delay}s from " + (resume or "the start (no checkpoint yet)"),
        )
    )


def _restarts(status: dict[str, Any]) -> dict[str, Any]:
    """A copy of status.restarts to change, zeros when there is none yet."""
    return dict(status.get("restarts") or {"failures": 0, "preemptions": 0, "total": 0})


def _count_in_place_restart(plan: Plan, o: Observed, attempt: int, job: dict[str, Any]) -> None:
    """Pods replaced within the attempt that status has not counted yet (the backend says which): counted as in-place
    restarts, with an Event."""
    restarts = _restarts(o.status)
    replaced = o.backend.pods_replaced(job, o.parts, restarts)
    if replaced is None:
        return
    more, marks, said = replaced
    restarts["inPlace"] = int(restarts.get("inPlace") or 0) + more
    restarts.update(marks)
    plan.status["restarts"] = restarts
    plan.events.append(
        Note(
            "Warning",
            "PodsRestarted",
            f"attempt {attempt}: {said} "
            f"Its pods rejoin and resume from the last checkpoint (in-place restart "
            f"{restarts['inPlace']} of this run; {o.backend.replacer} allows "
            f"{o.run.spec.recovery.max_restarts_per_attempt} per attempt, spec.recovery.maxRestartsPerAttempt).",
        )
    )


def _fail(plan: Plan, o: Observed, reason: str, message: str, conditions: Conditions) -> None:
    plan.status.update(phase="Failed", completionTime=rfc3339(o.now), nextAttemptTime=None)
    conditions.set("Failed", True, reason, message)
    plan.events.append(Note("Warning", reason, message))
    # Here, not on the next reconcile: that one is the echo of this status write, which is skipped.
    plan.delete_jobs += _old_jobs(o, keep_after=int(o.status.get("attempt") or 0) - 1, keep=0)


def _hung_twice_on_a_node(plan: Plan, o: Observed, attempt: int, job_name: str, conditions: Conditions) -> bool:
    """A node named in a hang (status.lastHang.nodes) and in the hang before it (status.hangNodes), on which a pod of
    the run ran, is avoided from now on (status.avoidedNodes, a node affinity of every later attempt's pods) and the
    attempt ends, charged as a failure, so that the next one runs elsewhere: restarting in place would keep it there.
    True when it ended."""
    hang, before = o.status.get("lastHang") or {}, o.status.get("hangNodes") or {}
    if not hang or hang.get("time") == before.get("time"):
        return False  # no hang, or this one was looked at already
    nodes = [node for node in hang.get("nodes") or [] if isinstance(node, str)]
    plan.status["hangNodes"] = {"time": hang.get("time"), "nodes": nodes}
    # Only a node the run's own pods ran on: a report is a pod's word, and must not move (or cordon) any other node.
    ran_on = {(pod.get("spec") or {}).get("nodeName") for pod in o.pods}
    repeated = sorted(set(nodes) & set(before.get("nodes") or []) & ran_on)
    if not repeated:
        return False
    kept = [node for node in o.status.get("avoidedNodes") or [] if node not in repeated]
    plan.status["avoidedNodes"] = [*kept, *repeated][-kube_shapes.MAX_AVOIDED_NODES :]
    plan.cordon_nodes = repeated
    named = ", ".join(repeated)
    detail = f"node {named} held the run up in two hangs in a row (the last after step {hang.get('step')})"
    plan.events.append(
        Note(
            "Warning",
            "AvoidingNode",
            f"attempt {attempt}: {detail}; it ends so that the next attempt runs elsewhere: its pods avoid {named} "
            "(status.avoidedNodes)",
        )
    )
    plan.delete_jobs.append(job_name)
    _attempt_ended(plan, o, attempt, Failure("failure", detail), conditions)
    return True


def _check_stall(plan: Plan, o: Observed, attempt: int, job_name: str, conditions: Conditions) -> None:
    """Reports arrive (rank 0 reports every 10 s, also when nothing changed) but the step does not move: a stall,
    restarted. No reports at all: the pods may train fine and not reach the report endpoint (network policy,
    certificate), so that is a condition, never a restart."""
    timeout = o.run.spec.recovery.stall_timeout_seconds
    if not timeout:
        return
    progress = o.status.get("progress") or {}
    started = parse_time(o.status.get("attemptStartTime"))
    heard = parse_time(o.status.get("lastReportTime"))
    heard = heard if heard and started and heard >= started else None
    silent_since = heard or started or o.now
    if (o.now - silent_since).total_seconds() >= timeout:
        since = f"since {heard.isoformat()}" if heard else f"since attempt {attempt} started"
        message = (
            f"no report from attempt {attempt}'s rank 0 {since}, for more than "
            f"spec.recovery.stallTimeoutSeconds={timeout}s; its pods are not restarted for that (they may be "
            "training): check that they reach the operator's report endpoint (network policy, certificate)"
        )
        if conditions.set("ReportingUnavailable", True, "NoReports", message):
            plan.events.append(Note("Warning", "ReportingUnavailable", message))
        return
    plan.recheck(silent_since + timedelta(seconds=timeout))
    if conditions.is_true("ReportingUnavailable"):
        conditions.set("ReportingUnavailable", False, "ReportsArrive", "rank 0's reports arrive again")
    reported = parse_time(progress.get("updatedAt"))
    last = max([t for t in (reported, started) if t is not None], default=None)
    if last is None or (o.now - last).total_seconds() < timeout:
        if last is not None:
            plan.recheck(last + timedelta(seconds=timeout))
        return
    if reported and started and reported >= started:
        where = f"last step {progress.get('step')} finished at {progress.get('updatedAt')}"
    else:
        where = f"no step finished since attempt {attempt} started at {o.status.get('attemptStartTime')}"
    detail = f"rank 0 reports, but training has not moved for more than spec.recovery.stallTimeoutSeconds={timeout}s ({where})"
    plan.events.append(Note("Warning", "Stalled", f"attempt {attempt}: {detail}; restarting it"))
    plan.delete_jobs.append(job_name)
    _attempt_ended(plan, o, attempt, Failure("failure", detail), conditions, stalled=True)


def _finish(plan: Plan, o: Observed, conditions: Conditions) -> Plan:
    """Status fields computed from everything else; only what differs from the current status stays."""
    if conditions.changed:
        plan.status["conditions"] = conditions.as_list()
    figure = goodput(o.status)
    if figure is not None:
        plan.status["goodput"] = figure
    if o.run.metadata.generation is not None:
        plan.status["observedGeneration"] = o.run.metadata.generation
    plan.status = {k: v for k, v in plan.status.items() if o.status.get(k) != v}
    return plan
