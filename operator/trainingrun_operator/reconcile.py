"""What to do for one TrainingRun, decided from what is observed. Pure: no API calls, no clock.

`decide(Observed) -> Plan` is the whole operator logic: which attempt should exist, how a failed
attempt is classified and charged, when the next one starts, what the status and conditions say
and which Events tell the story. The kopf handlers (handlers.py) only gather the observation from
kopf's in-memory indexes and carry the plan out, so every decision here is unit-tested without a
cluster, and a restarted operator decides the same from the same status.

Everything the operator must remember lives in `status`: attempt, jobName, restarts by cause,
nextAttemptTime while Recovering, startTime for goodput and the checkpoint URI the run started with.

Slightly over 500 lines: one decision function and the helpers that read pods and jobs for it, kept together
so a reader sees the whole decision; the recovery policy itself is in recovery.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Optional

from trainingrun_api import contract, exit_codes, progress_report

from . import api, builders, naming, recovery
from .builders import Note

TERMINAL = ("Succeeded", "Failed")
KUBEFLOW_JOB_NAME_LABEL = "training.kubeflow.org/job-name"
#: Pod-level reasons that mean the node or the scheduler took the pod away, not the training code.
DISRUPTION_POD_REASONS = {"Evicted", "Preempting", "Terminated", "NodeShutdown", "Shutdown", "NodeLost"}
#: How long a failed PyTorchJob whose pods show no reason yet is given for the pod watch to catch up
#: (the job and pod watches are separate streams); after that it is classified as a failure.
FAILURE_EVIDENCE_GRACE = timedelta(seconds=30)


@dataclass
class Observed:
    """One run and its children as the operator sees them now."""

    run: api.TrainingRun
    status: dict[str, Any]  #: wire form (camelCase)
    jobs: dict[str, dict[str, Any]]  #: this run's PyTorchJobs by name
    pods: list[dict[str, Any]]  #: this run's pods, every attempt
    now: datetime
    keep_failed_attempts: int = 1  #: failed attempts whose PyTorchJob (and pods, for logs) stay until the run ends
    #: Warning Events about the current attempt's job and pods (reason, message, involvedObject), read only while
    #: an attempt has been Pending for a while: they are how pods that are never created, never scheduled or
    #: never started show (Kubeflow's FailedCreate, the kubelet's FailedMount).
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Plan:
    status: dict[str, Any] = field(default_factory=dict)  #: merge patch for status
    start_attempt: Optional[int] = None  #: create (or adopt) the children of this attempt
    resume_from: Optional[str] = None  #: TRAININGRUN_RESUME_FROM of that attempt
    checkpoint_uri: str = ""  #: the URI attempts use (the one the run started with); `decide` always sets it
    suspend_job: Optional[str] = None
    delete_jobs: list[str] = field(default_factory=list)
    events: list[Note] = field(default_factory=list)
    restart_cause: Optional[str] = None  #: failure, preemption or stall, when an attempt ended here (metrics)
    attempt_cause: Optional[str] = None  #: initial, recovery, resume or recreate, when an attempt starts (metrics)


@dataclass
class Failure:
    cause: str  #: permanent, preemption or failure
    detail: str  #: what happened, for the Event and the condition
    exit_code: Optional[int] = None
    from_pods: bool = True  #: False when no pod said why (they may be gone, or not seen yet)


# ---------------------------------------------------------------- small pure helpers


rfc3339, parse_time = contract.rfc3339, contract.parse_time  # the one pair of time helpers, used here often


def job_state(job: dict[str, Any]) -> Optional[str]:
    """Succeeded, Failed, Suspended, Running, Restarting or Created, from the Kubeflow job conditions."""
    true = {c.get("type") for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
    for state in ("Succeeded", "Failed", "Suspended", "Running", "Restarting", "Created"):
        if state in true:
            return state
    return None


def restarting(job: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The PyTorchJob's Restarting condition while it is true: Kubeflow sets it (and drops Running) each time it
    replaces a pod of the job, and drops it when the job runs again."""
    return next(
        (
            c
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("type") == "Restarting" and c.get("status") == "True"
        ),
        None,
    )


def attempt_of(obj: dict[str, Any]) -> Optional[int]:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_ATTEMPT)
    return int(value) if value and value.isdigit() else None


def pods_of(pods: list[dict[str, Any]], job_name: str, attempt: int) -> list[dict[str, Any]]:
    def belongs(pod: dict[str, Any]) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return labels.get(KUBEFLOW_JOB_NAME_LABEL) == job_name or attempt_of(pod) == attempt

    return [p for p in pods if belongs(p)]


def _trainer_terminations(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer container's termination records (current state and the last one)."""
    found = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != naming.CONTAINER_NAME:
            continue
        for key in ("state", "lastState"):
            terminated = (status.get(key) or {}).get("terminated")
            if terminated:
                found.append(terminated)
    return found


def _disruption(pod: dict[str, Any]) -> Optional[str]:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"pod {pod['metadata']['name']} was disrupted ({condition.get('reason') or 'DisruptionTarget'})"
    if status.get("reason") in DISRUPTION_POD_REASONS:
        return f"pod {pod['metadata']['name']} was {status['reason'].lower()}: {status.get('message') or ''}".rstrip(
            ": "
        )
    return None


def classify_failure(job: dict[str, Any], pods: list[dict[str, Any]]) -> Failure:
    """Why an attempt's PyTorchJob failed: preemption, a permanent error, or a (retryable) failure.

    A disrupted pod (DisruptionTarget condition, eviction, node shutdown) or the launcher's exit 143
    (emergency checkpoint after SIGTERM) is a preemption; 137 is one too when the pod was being
    deleted (SIGKILL after the grace period), else an OOM kill or crash. Exit codes 1-127 are the
    trainer's permanent verdicts (bad config, divergence): retrying cannot help.
    """
    for pod in pods:
        disrupted = _disruption(pod)
        if disrupted:
            return Failure("preemption", disrupted)
    codes = []
    for pod in pods:
        deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        for terminated in _trainer_terminations(pod):
            code = terminated.get("exitCode")
            if code is None or code == 0:
                continue
            name = pod["metadata"]["name"]
            message = (terminated.get("message") or "").strip()
            reason = terminated.get("reason") or ""
            codes.append((code, name, reason, message, deleting))
    for code, name, _reason, _message, deleting in codes:
        if exit_codes.classify(code, stopping=deleting) == exit_codes.PREEMPTION:
            return Failure("preemption", f"pod {name} stopped after SIGTERM (exit code {code})", code)
    for code, name, reason, message, _ in codes:
        if exit_codes.classify(code) == exit_codes.PERMANENT:
            said = f": {message}" if message else (f" ({reason})" if reason else "")
            return Failure("permanent", f"pod {name} exited with {code}{said}", code)
    if codes:
        code, name, reason, message, _ = codes[0]
        said = f" ({reason})" if reason else ""
        return Failure("failure", f"pod {name} exited with {code}{said}", code)
    job_message = next(
        (
            c.get("message")
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("type") == "Failed" and c.get("status") == "True"
        ),
        None,
    )
    return Failure(
        "failure", f"PyTorchJob {job['metadata']['name']} failed: {job_message or 'no reason given'}", from_pods=False
    )


def failed_since(job: dict[str, Any]) -> Optional[datetime]:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return parse_time(condition.get("lastTransitionTime"))
    return None


def _names(message: str, secret_name: str) -> bool:
    """Whether a kubelet message names this Secret: `secret "s3" not found`, `... in Secret ns/s3`."""
    return re.search(rf'(^|["/\s]){re.escape(secret_name)}($|["\s:,;])', message) is not None


def missing_secret(pods: list[dict[str, Any]], secret_names: list[str]) -> Optional[str]:
    """The kubelet's message for a container that cannot start because a Secret or key is missing, with the
    Secrets the run reads when the message names none of them: a kubelet whose Secret cache has not synced yet
    says only "failed to sync secret cache: timed out waiting for the condition"."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError":
                message = waiting.get("message") or "a Secret or key is missing"
                if secret_names and not any(_names(message, name) for name in secret_names):
                    message += (
                        f" (the run reads Secret{'s' if len(secret_names) > 1 else ''} {', '.join(secret_names)})"
                    )
                return f"pod {pod['metadata']['name']}: {message}"
    return None


#: Why an attempt's pods do not run, by condition type: (reason, message). Reported while the run is Pending
#: or Running (a replacement pod within the attempt).
BLOCKED_CONDITIONS = ("PodsNotCreated", "Unschedulable", "VolumeMountFailed")
FAILED_CREATE_REASONS = ("FailedCreate", "FailedCreatePod")  # what Kubeflow's pod control records on the job


def blocked_pods(
    job_name: str, pods: list[dict[str, Any]], warnings: list[dict[str, Any]]
) -> dict[str, tuple[str, str]]:
    """What keeps an attempt's pods from running, from the scheduler's pod conditions and the Warning Events
    of Kubeflow (on the job) and the kubelet (on the pods). A missing Secret volume is `missing_secret_volume`'s."""
    found: dict[str, tuple[str, str]] = {}
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"
            ):
                found.setdefault(
                    "Unschedulable",
                    ("Unschedulable", f"pod {pod['metadata']['name']}: {condition.get('message') or 'no node fits'}"),
                )
    for event in warnings:
        about, reason, message = (
            (event.get("involvedObject") or {}).get("name"),
            event.get("reason"),
            event.get("message"),
        )
        if about == job_name and reason in FAILED_CREATE_REASONS:
            found.setdefault("PodsNotCreated", ("FailedCreate", f"PyTorchJob {job_name}: {message}"))
        elif reason == "FailedMount" and not _about_secret(message):
            found.setdefault("VolumeMountFailed", ("FailedMount", f"pod {about}: {message}"))
    return found


def _about_secret(message: Any) -> bool:
    return isinstance(message, str) and 'secret "' in message and "not found" in message


def missing_secret_volume(warnings: list[dict[str, Any]]) -> Optional[str]:
    """The kubelet's FailedMount message for a Secret volume (the GCS key file) that does not exist."""
    for event in warnings:
        if event.get("reason") == "FailedMount" and _about_secret(event.get("message")):
            return f"pod {(event.get('involvedObject') or {}).get('name')}: {event['message']}"
    return None


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
    figure = progress_report.goodput(productive, (reported - started).total_seconds())
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
    parts = progress_report.time_breakdown(max(0.0, wall), processes, productive_seconds, backoff)
    breakdown = api.TimeBreakdown(
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
            "lastTransitionTime": self.now if flipped else old.get("lastTransitionTime", self.now),
        }
        if self.generation is not None:
            new["observedGeneration"] = self.generation
        if new != old:
            self.items[type_], self.changed = new, True
        return flipped

    def as_list(self) -> list[dict[str, Any]]:
        return list(self.items.values())


# ---------------------------------------------------------------- the decision


def decide(o: Observed) -> Plan:
    plan = Plan()
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
        plan.status.update(startTime=now, checkpointUri=spec.checkpoint.uri)
        if spec.suspend:
            plan.status["phase"] = "Suspended"
        return _finish(plan, o, conditions)

    job_name = status.get("jobName") or naming.job_name(o.run.metadata.name, attempt)
    job = o.jobs.get(job_name)
    _check_spec(plan, o, job, conditions)

    if spec.suspend:
        if phase != "Suspended":
            if job is not None and job_state(job) not in TERMINAL:
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
        return _finish(plan, o, conditions)

    # Pending or Running: follow the current attempt.
    if job is None:
        # Created but not seen yet, or removed by someone: (re)create it; an existing one is adopted.
        plan.start_attempt, plan.resume_from, plan.attempt_cause = attempt, _last_good(status), "recreate"
        return _finish(plan, o, conditions)

    pods = pods_of(o.pods, job_name, attempt)
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

    state = job_state(job)
    # Also while Running: a pod replaced within the attempt (deleted, evicted, its node gone) can find no node.
    blocked = blocked_pods(job_name, pods, o.warnings) if state not in TERMINAL else {}
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
            return _finish(plan, o, conditions)  # the pods' story is probably on its way: decide then
        _attempt_ended(plan, o, attempt, failure, conditions)
    else:
        _count_in_place_restart(plan, o, attempt, job)
        if state == "Running" and phase == "Pending":
            plan.status["phase"] = "Running"
            plan.events.append(Note("Normal", "Running", f"attempt {attempt} is running (PyTorchJob {job_name})"))
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
    since = (
        conditions.items.get("WaitingForOldPods", {}).get("lastTransitionTime")
        if conditions.is_true("WaitingForOldPods")
        else None
    )
    limit = timedelta(seconds=o.run.spec.termination_grace_period_seconds) + OLD_PODS_SLACK
    waited_out = since is not None and o.now >= (parse_time(since) or o.now) + limit
    if stopping and not waited_out:
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
    """This run's PyTorchJobs of attempts up to `keep_after`, except the newest `keep` of them."""
    old = sorted((attempt_of(j) or 0, name) for name, j in o.jobs.items() if (attempt_of(j) or 0) <= keep_after)
    return [name for _, name in old[: max(0, len(old) - keep)]]


def _start(
    plan: Plan, o: Observed, number: int, cause: str, conditions: Conditions, resume_from: Optional[str]
) -> None:
    name = naming.job_name(o.run.metadata.name, number)
    plan.start_attempt, plan.resume_from, plan.attempt_cause = number, resume_from, cause
    plan.status.update(
        phase="Pending",
        attempt=number,
        jobName=name,
        attemptStartTime=rfc3339(o.now),
        nextAttemptTime=None,
        checkpointInMemory=None,
    )
    if conditions.is_true("SpecChangePending"):
        conditions.set("SpecChangePending", False, "Applied", f"attempt {number} runs the current spec")
    where = f"resuming from {resume_from}" if resume_from else "from the start"
    plan.events.append(Note("Normal", "AttemptStarted", f"attempt {number} started (PyTorchJob {name}), {where}"))
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
    """A Restarting condition not counted yet (its transition time is the key): one more in-place restart."""
    condition = restarting(job)
    restarts = _restarts(o.status)
    since = condition and condition.get("lastTransitionTime")
    if not since or since == restarts.get("lastInPlaceTime"):
        return
    restarts["inPlace"] = int(restarts.get("inPlace") or 0) + 1
    restarts["lastInPlaceTime"] = since
    plan.status["restarts"] = restarts
    plan.events.append(
        Note(
            "Warning",
            "PodsRestarted",
            f"attempt {attempt}: {condition.get('message') or 'pods restarted'} "
            f"Its pods rejoin and resume from the last checkpoint (in-place restart "
            f"{restarts['inPlace']} of this run; Kubeflow allows {o.run.spec.recovery.max_restarts_per_attempt} "
            "per attempt, spec.recovery.maxRestartsPerAttempt).",
        )
    )


def _fail(plan: Plan, o: Observed, reason: str, message: str, conditions: Conditions) -> None:
    plan.status.update(phase="Failed", completionTime=rfc3339(o.now), nextAttemptTime=None)
    conditions.set("Failed", True, reason, message)
    plan.events.append(Note("Warning", reason, message))


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
    if (o.now - (heard or started or o.now)).total_seconds() > timeout:
        since = f"since {heard.isoformat()}" if heard else f"since attempt {attempt} started"
        message = (
            f"no report from attempt {attempt}'s rank 0 {since}, for more than "
            f"spec.recovery.stallTimeoutSeconds={timeout}s; its pods are not restarted for that (they may be "
            "training): check that they reach the operator's report endpoint (network policy, certificate)"
        )
        if conditions.set("ReportingUnavailable", True, "NoReports", message):
            plan.events.append(Note("Warning", "ReportingUnavailable", message))
        return
    if conditions.is_true("ReportingUnavailable"):
        conditions.set("ReportingUnavailable", False, "ReportsArrive", "rank 0's reports arrive again")
    reported = parse_time(progress.get("updatedAt"))
    last = max([t for t in (reported, started) if t is not None], default=None)
    if last is None or (o.now - last).total_seconds() <= timeout:
        return
    if reported and started and reported >= started:
        where = f"last step {progress.get('step')} finished at {progress.get('updatedAt')}"
    else:
        where = f"no step finished since attempt {attempt} started at {o.status.get('attemptStartTime')}"
    detail = f"rank 0 reports, but training has not moved for more than spec.recovery.stallTimeoutSeconds={timeout}s ({where})"
    plan.events.append(Note("Warning", "Stalled", f"attempt {attempt}: {detail}; restarting it"))
    plan.delete_jobs.append(job_name)
    _attempt_ended(plan, o, attempt, Failure("failure", detail), conditions, stalled=True)


def _check_spec(plan: Plan, o: Observed, job: Optional[dict[str, Any]], conditions: Conditions) -> None:
    """Immutable fields are refused; other changes wait for the next attempt, and say so."""
    started_uri, wanted_uri = plan.checkpoint_uri, o.run.spec.checkpoint.uri
    if wanted_uri != started_uri:
        message = (
            f"spec.checkpoint.uri cannot change once the run has started (it is {started_uri}): "
            "set it back, or create a new TrainingRun to train elsewhere"
        )
        if conditions.set("SpecRejected", True, "CheckpointUriImmutable", message):
            plan.events.append(Note("Warning", "SpecRejected", message))
    elif conditions.is_true("SpecRejected"):
        conditions.set("SpecRejected", False, "Accepted", "the spec is accepted")
    if job is None or o.status.get("phase") in TERMINAL:
        return
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    if o.run.metadata.generation is not None and annotations.get(naming.ANNOTATION_GENERATION) == str(
        o.run.metadata.generation
    ):
        return  # built from this very spec
    built_from = annotations.get(naming.ANNOTATION_SPEC_HASH)
    if built_from and built_from != naming.spec_hash(builders.as_started(o.run, started_uri)):
        attempt = int(o.status.get("attempt") or 0)
        message = (
            f"the spec changed; attempt {attempt} keeps running as it was built, "
            f"the change applies from attempt {attempt + 1} (suspend and resume the run to apply it now)"
        )
        if conditions.set("SpecChangePending", True, "AppliesOnNextAttempt", message):
            plan.events.append(Note("Normal", "SpecChangePending", message))


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
