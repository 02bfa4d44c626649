"""Carrying out a plan (`reconcile.Plan`) through the API server: an attempt's children created or adopted (only
when the run controls them; refusals backed off), suspension, deletions, then status (remembered until the watch
shows it, so two quick triggers never charge one failure twice), then Events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional, TypeGuard

from trainingrun_api import contract

from . import api, api_status, builders, naming, reconcile, run_status, validation
from .backends import JOB_KINDS
from .builders import Note
from .indexes import controller_uid, job_view, merged_status, run_owns_job, slim_job
from .runtime import kube as kube_module
from .runtime.kube import ApiError, Kube
from .state import Key, OperatorState, Rejection

log = logging.getLogger("trainingrun.operator")

#: Status fields remembered from the operator's own writes until the watch shows them: every field of the status, as
#: the operator alone writes status (progress and lastGoodCheckpoint as pods reported them, see reports.py). Written
#: out by hand, the list once lacked `backend`: a JobSet run's next reconcile before the watch caught up read its
#: remembered jobName without it, took the run for a PyTorchJob one, and suspended (or recreated) the wrong kind.
OPERATOR_FIELDS = tuple(field.alias or name for name, field in api_status.TrainingRunStatus.model_fields.items())


def remembered(status_patch: dict[str, Any]) -> dict[str, Any]:
    """What of a status patch the operator remembers until the watch shows it."""
    return {k: v for k, v in status_patch.items() if k in OPERATOR_FIELDS}


async def carry_out(
    state: OperatorState,
    key: Key,
    run: Optional[api.TrainingRun],
    body: dict[str, Any],
    plan: reconcile.Plan,
    job_uids: Optional[dict[str, str]] = None,
) -> bool:
    """Children, suspension, deletions, then status (remembered until the watch shows it), then Events.
    `run` (the parsed spec) is needed only when the plan starts an attempt; `job_uids` (name: uid of the
    run's own jobs) only when it deletes jobs. False when it stopped before the status: the children must wait."""
    kube, (namespace, name) = state.client(), key
    if plan.start_attempt:
        assert run is not None
        job_name = naming.job_name(name, plan.start_attempt)
        if not (plan.attempt_cause == "recreate" and (namespace, job_name) in state.created_jobs):
            if not await _create_children(state, key, body, plan, run, plan.start_attempt, job_name):
                return False
    backend = plan.backend
    if plan.suspend_job:
        if (left := state.reconciled.get(key)) is not None:
            left.jobs.pop(plan.suspend_job, None)
        try:
            await kube.patch(backend.api_version, backend.kind, namespace, plan.suspend_job, backend.suspend_patch())
        except ApiError as error:
            if error.status != 404:  # no such job (removed by someone): nothing of it runs, nothing to suspend
                raise
    for job_name in plan.delete_jobs:
        try:  # exactly the job this run owns: the name may belong to someone else's object by now
            await kube.delete(
                backend.api_version, backend.kind, namespace, job_name, uid=(job_uids or {}).get(job_name)
            )
        except ApiError as error:
            if error.status != 409:
                raise
        state.created_jobs.discard((namespace, job_name))
    if plan.status:
        await kube.patch(
            api.API_VERSION,
            api.KIND,
            namespace,
            name,
            {"status": plan.status},
            subresource="status",
            priority=kube_module.STATUS,
        )
        written = state.written.setdefault(key, {})
        written.update(remembered(plan.status))
        if plan.restart_cause:
            state.metrics.restarts.labels(namespace, name, plan.restart_cause).inc()
        if any(note.reason == "Hung" for note in plan.events):  # a new hang turned the condition true
            state.metrics.hangs.labels(namespace, name).inc()
    if state.settings.cordon_avoided_nodes:
        plan.events += [await _cordon(kube, node) for node in plan.cordon_nodes]
    for note in plan.events:
        state.queue_event(body, note)
    return True


async def _cordon(kube: Kube, node: str) -> Note:
    """Mark `node` unschedulable, as `kubectl cordon` does (operator.cordonAvoidedNodes); an Event either way."""
    try:
        await kube.patch("v1", "Node", "", node, {"spec": {"unschedulable": True}})
    except ApiError as error:
        return Note("Warning", "NodeNotCordoned", f"could not cordon node {node} ({error.status} {error.reason})")
    return Note(
        "Warning",
        "NodeCordoned",
        f"node {node} is cordoned (operator.cordonAvoidedNodes): `kubectl uncordon {node}` once it is repaired",
    )


async def _create_children(
    state: OperatorState,
    key: Key,
    body: dict[str, Any],
    plan: reconcile.Plan,
    run: api.TrainingRun,
    attempt: int,
    job_name: str,
) -> bool:
    """Create (or adopt) attempt `attempt`'s children; False when the plan must wait (refused now or recently)."""
    kube, generation = state.client(), (body.get("metadata") or {}).get("generation")
    held = state.rejections.get(key)
    if held and held.generation == generation and time.monotonic() < held.retry_at:
        state.rechecks.at(key, held.retry_at)
        return False  # the server refused this spec's children: wait for the backoff or a spec change
    *support, job = plan.backend.children(
        run, attempt, state.settings, plan.resume_from, plan.checkpoint_uri, avoid_nodes=plan.avoid_nodes
    )
    # All at once: in a burst of runs, sending the ConfigMap first put every job behind every run's other
    # create (p50 create->job ~1 s against ~0.5 s). The Kubeflow operator creates pods only after it has seen
    # the job; a pod that finds no ConfigMap yet waits in ContainerCreating until it exists. Status is
    # written only when both exist, so a failure here starts the same attempt again.
    ordered = [job, *support]
    left = state.reconciled.get(key)
    if left is not None:  # before the request: the watch may show the job before its answer comes
        left.jobs[job_name] = job_view(slim_job(job, plan.backend))
    signer = JobSigner(state.settings.signing_key, str(run.metadata.uid), state.made_jobs)
    outcomes = await asyncio.gather(*(_ensure(kube, child, signer) for child in ordered), return_exceptions=True)
    if not isinstance(outcomes[0], BaseException):
        state.created_jobs.add((key[0], job_name))
    if outcomes[0] is True:  # the job is new, not adopted
        state.metrics.attempts.labels(plan.attempt_cause or "initial").inc()
    conflicts = [(child, outcome) for child, outcome in zip(ordered, outcomes) if isinstance(outcome, NotOwned)]
    refused = [(child, outcome) for child, outcome in zip(ordered, outcomes) if _is_refusal(outcome)]
    if conflicts or refused:
        await _children_refused(state, key, body, refused, conflicts)
        return False
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failed:
        raise failed[0]
    if state.rejections.pop(key, None) is not None:
        status = merged_status(body.get("status") or {}, state.written.get(key, {}))
        conditions = run_status.Conditions(
            plan.status.get("conditions") or status.get("conditions") or [],
            contract.rfc3339(state.clock()),
            generation,
        )
        conditions.set("ChildRejected", False, "Accepted", "the API server accepted this attempt's objects")
        conditions.set("NameConflict", False, "Resolved", "every object of this attempt is the run's own")
        if conditions.changed:
            plan.status["conditions"] = conditions.as_list()
    return True


#: Answers to a create that come right by waiting (namespace or CRD appearing, already exists, throttled);
#: any other 4xx refuses the object itself, and retrying the same object would be refused again.
TRANSIENT_CREATE_STATUSES = {404, 409, 429}
CHILD_REJECTED_MAX_BACKOFF_SECONDS = 300.0


def _is_refusal(outcome: Any) -> TypeGuard[ApiError]:
    return (
        isinstance(outcome, ApiError)
        and 400 <= outcome.status < 500
        and outcome.status not in TRANSIENT_CREATE_STATUSES
    )


async def _children_refused(
    state: OperatorState,
    key: Key,
    body: dict[str, Any],
    refused: list[tuple[dict[str, Any], ApiError]],
    conflicts: list[tuple[dict[str, Any], "NotOwned"]],
) -> None:
    """The API server refused a child (condition ChildRejected with its words), or a child's name is taken by
    an object this run does not own (condition NameConflict; that object is left as it is): one Event each,
    and a backoff instead of the same answer at every resync. A spec change (new generation) tries at once."""
    generation = (body.get("metadata") or {}).get("generation")
    previous = state.rejections.get(key)
    first, cap = state.settings.child_rejected_backoff_seconds, CHILD_REJECTED_MAX_BACKOFF_SECONDS
    delay = min(previous.delay * 2, cap) if previous and previous.generation == generation else first
    state.rejections[key] = Rejection(generation, time.monotonic() + delay, delay)
    state.rechecks.at(key, state.rejections[key].retry_at)
    status = merged_status(body.get("status") or {}, state.written.get(key, {}))
    conditions = run_status.Conditions(status.get("conditions") or [], contract.rfc3339(state.clock()), generation)
    events = []
    retry = f"next try in {delay:.0f}s, or at once after a spec change"
    if refused:
        message = "; ".join(
            f"{c['kind']} {c['metadata']['name']}: {e.status} {e.reason}: {e.message}" for c, e in refused
        )[:2000]
        if conditions.set(
            "ChildRejected", True, "ChildRejected", f"the API server refused this run's objects ({retry}): {message}"
        ):
            log.warning("%s/%s: the API server refused its objects: %s", key[0], key[1], message)
            events.append(builders.Note("Warning", "ChildRejected", message))
    if conflicts:
        message = (
            "; ".join(str(conflict) for _, conflict in conflicts)
            + f"; this run changes and deletes only its own objects: delete or rename "
            f"{'those' if len(conflicts) > 1 else 'it'}, or create the run under another name"
        )[:2000]
        if conditions.set("NameConflict", True, "NotOwned", f"{message} ({retry})"):
            log.warning("%s/%s: %s", key[0], key[1], message)
            events.append(builders.Note("Warning", "NameConflict", message))
    if conditions.changed:
        plan = reconcile.Plan(status={"conditions": conditions.as_list()}, events=events)
        await carry_out(state, key, None, body, plan)


class NotOwned(Exception):
    """A child's name is taken by an object whose controller is not this run."""

    def __init__(self, child: dict[str, Any]):
        super().__init__(
            f"{child['kind']} {child['metadata']['name']} already exists and is not controlled by "
            "this run (left as it is)"
        )


@dataclass
class JobSigner:
    """Signs the jobs (PyTorchJobs, JobSets) the operator creates for one run (naming.job_signature: the job's uid, which only its
    creation gives, so a signature is written right after) and remembers their uids in `made`
    (OperatorState.made_jobs). Without a key (tests) nothing is signed."""

    key: bytes
    run_uid: str
    made: set[str]

    async def sign(self, kube: Kube, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        if not self.key:
            return
        self.made.add(meta["uid"])
        signature = naming.job_signature(self.key, self.run_uid, meta["name"], meta["uid"])
        await kube.patch(
            job["apiVersion"],
            job["kind"],
            meta["namespace"],
            meta["name"],
            [
                {"op": "test", "path": "/metadata/uid", "value": meta["uid"]},
                {
                    "op": "add",
                    "path": "/metadata/annotations/" + _pointer(naming.ANNOTATION_SIGNATURE),
                    "value": signature,
                },
            ],
            json_patch=True,
        )

    def signed(self, job: dict[str, Any]) -> bool:
        """Whether an existing job is the run's own (indexes.run_owns_job, less what only status tells)."""
        return run_owns_job(job, self.run_uid, {}, self.key, datetime.min.replace(tzinfo=timezone.utc), self.made)


def _pointer(name: str) -> str:
    """`name` as one JSON pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


async def _ensure(kube: Kube, child: dict[str, Any], signer: JobSigner) -> bool:
    """Create a child. If the name exists and this run controls that object, bring it up to date (a job
    is never changed, and must be one this operator made: `signer`); if anyone else does, or no one, raise NotOwned
    and leave it untouched.

    One JSON patch whose first operations test the controller reference: the server applies all of it or
    none (422), so an object that is not the run's is never written, not even between a read and a write,
    and the operator needs no read access to ConfigMaps."""
    job = child["kind"] in JOB_KINDS
    try:
        created = await kube.create(child, answer=job)
    except ApiError as error:
        if error.status != 409:
            raise
    else:
        uid = (created.get("metadata") or {}).get("uid")
        if job and uid:  # (kmock gives no uids)
            await signer.sign(kube, {**child, "metadata": {**child["metadata"], "uid": uid}})
        return True
    meta = child["metadata"]
    if job:  # used as it is, never written: it must be one this operator made for this run
        found = await kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        if not signer.signed(found):
            raise NotOwned(child)
        return False
    operations: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": controller_uid(child)},
        {"op": "test", "path": "/metadata/ownerReferences/0/controller", "value": True},
    ]
    operations.append({"op": "add", "path": "/metadata/labels", "value": meta.get("labels") or {}})
    operations += [
        {"op": "add", "path": f"/{key}", "value": value}
        for key, value in child.items()
        if key not in ("apiVersion", "kind", "metadata", "spec")
    ]
    # Field by field: a Service's spec also holds what the server allocated (clusterIP), which must stay.
    operations += [
        {"op": "add", "path": f"/spec/{key}", "value": value} for key, value in (child.get("spec") or {}).items()
    ]
    try:
        await kube.patch(
            child["apiVersion"], child["kind"], meta["namespace"], meta["name"], operations, json_patch=True
        )
    except ApiError as error:
        if error.status == 422:  # a test operation failed
            raise NotOwned(child) from None
        raise
    return False


async def reject(
    state: OperatorState, key: Key, body: dict[str, Any], status: dict[str, Any], error: validation.InvalidTrainingRun
) -> None:
    """A spec the CRD let through but the operator cannot run: say why, create nothing, wait for a fix."""
    message = "; ".join(str(p) for p in error.problems)[:2000]
    conditions = run_status.Conditions(
        status.get("conditions") or [], contract.rfc3339(state.clock()), (body.get("metadata") or {}).get("generation")
    )
    if conditions.set("SpecRejected", True, "InvalidSpec", message):
        plan = reconcile.Plan(
            status={"conditions": conditions.as_list()}, events=[builders.Note("Warning", "SpecRejected", message)]
        )
        await carry_out(state, key, None, body, plan)
