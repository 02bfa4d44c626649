"""kopf handlers: keep kopf's in-memory indexes of runs, jobs and pods, and reconcile on any change.

Every trigger (a TrainingRun event, a PyTorchJob or pod event, the periodic resync) queues the run's key;
a fixed number of workers take keys from the queue and run the same level-triggered `reconcile_run`: read
the run and its children from the indexes (no API reads), let `reconcile.decide` choose, then
create/patch/delete what the plan says and write status. A key already queued is not queued again: the
worker reads the indexes when it starts, so it sees every change that queued it. The kopf handlers only
queue, so kopf's per-event machinery is never held up by API calls: in a burst of 2,000 runs, reconciles
waiting inside kopf's handlers held ~4,000 of its handler stacks at once, most of the operator's memory.
Handlers stay thin; decisions are in reconcile.py, objects in builders.py, API calls in kube.py.

Runs are reconciled one at a time per run (a lock each), and the status fields the operator owns
are taken from its own last write until the watch delivers it, so two quick triggers can never
charge one failure twice or start an attempt twice. Everything else survives a restart in status.

What the indexes keep is in indexes.py, what the process keeps in memory in state.py, the HTTP servers (metrics,
readiness, reports) in serving.py, which replica acts in leadership.py. Over 500 lines still because carrying out a plan (children created or
updated only when the run controls them, refusals backed off, status, Events) is one path through the API
server; split it there (a module that carries out plans) before it grows further.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import kopf

from . import api, builders, indexes, leadership, naming, reconcile, serving, validation
from . import kube as kube_module
from .indexes import controller_uid, merged_status, run_document, slim_job, slim_pod, slim_run
from .kube import ApiError, Kube
from .state import Key, OperatorState, Rejection, WarningsRead

log = logging.getLogger("trainingrun.operator")

RUNS = (api.GROUP, api.VERSION, api.PLURAL)
JOBS = ("kubeflow.org", "v1", "pytorchjobs")
PODS = ("", "v1", "pods")
CHILD_FILTER = {naming.LABEL_RUN: kopf.PRESENT}
#: Status fields remembered from the operator's own writes until the watch shows them: all of them, as the
#: operator alone writes status (progress and lastGoodCheckpoint as pods reported them, see reports.py).
OPERATOR_FIELDS = (
    "phase",
    "attempt",
    "jobName",
    "startTime",
    "attemptStartTime",
    "nextAttemptTime",
    "checkpointUri",
    "completionTime",
    "restarts",
    "goodput",
    "conditions",
    "observedGeneration",
    "progress",
    "lastGoodCheckpoint",
    "checkpointInMemory",
    "lastReportTime",
)


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf keeps a copy of every body to diff for create/update handlers; this operator has none (it is level-
    triggered: on.event and indexes), and that copy was a fifth of its CPU in a burst of runs."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        pass


def register(registry: kopf.OperatorRegistry, state: OperatorState) -> None:
    """Add the operator's handlers to `registry`, bound to `state`."""

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The CRD's status schema is typed, so kopf keeps its own bookkeeping in annotations.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.posting.enabled = False  # Events are the operator's own, never copies of log lines
        settings.peering.name = state.settings.peering or "trainingrun-operator"
        settings.peering.standalone = not state.settings.peering
        settings.peering.mandatory = bool(state.settings.peering)
        if state.settings.peering:
            state.tasks.append(asyncio.create_task(_follow_peering(state), name="trainingrun-peering"))
        else:
            state.acting.set()
            state.metrics.acting.set(1)
        state.tasks.append(asyncio.create_task(serving.watch_crd(state), name="trainingrun-crd-check"))
        if state.settings.metrics_port:
            state.tasks.append(asyncio.create_task(serving.serve_metrics(state), name="trainingrun-metrics"))
        state.tasks.append(asyncio.create_task(_resync(state), name="trainingrun-resync"))
        state.tasks += [
            asyncio.create_task(_reconcile_worker(state), name=f"trainingrun-reconcile-{n}")
            for n in range(state.settings.reconcile_workers)
        ]
        state.tasks += [
            asyncio.create_task(_post_events(state), name=f"trainingrun-events-{n}") for n in range(EVENT_SENDERS)
        ]
        if state.settings.report_port and state.settings.report_url:
            state.tasks.append(asyncio.create_task(serving.serve_reports(state), name="trainingrun-reports"))
            if state.settings.report_service:
                state.tasks.append(
                    asyncio.create_task(serving.publish_report_endpoint(state), name="trainingrun-report-endpoint")
                )
        elif not state.settings.report_url:
            log.warning(
                "no report URL (TRAININGRUN_REPORT_URL): trainer pods will not report progress, and status "
                "will show no steps or checkpoints; the Helm chart sets it"
            )

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> Optional[kopf.ConnectionInfo]:
        try:
            info = await state.login(**kwargs)
        except kopf.PermanentError as error:
            state.fatal = str(error)  # kopf would wait forever; stop, and let the CLI exit 1 saying why
            if state.stop is not None and not state.stop.done():
                state.stop.set_result(None)
            raise
        if info is not None and info != state.connection:
            if state.kube is not None:
                await state.kube.close()
                state.kube = None
            state.connection = info
        state.logged_in.set()
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        if state.kube is not None:
            await state.kube.close()

    # Indexers are coroutines: kopf runs plain functions in a thread pool, a thread hop per watch event.
    @kopf.index(*RUNS, id="runs", registry=registry)
    async def runs(namespace: str, name: str, body: Any, **_: Any) -> dict[Key, dict[str, Any]]:
        return {(namespace, name): slim_run(body)}

    @kopf.index(*JOBS, labels=CHILD_FILTER, id="jobs", registry=registry)
    async def jobs(namespace: str, labels: Any, body: Any, **_: Any) -> dict[Key, dict[str, Any]]:
        return {(namespace, labels[naming.LABEL_RUN]): slim_job(body)}

    @kopf.index(*PODS, labels=CHILD_FILTER, id="pods", registry=registry)
    async def pods(namespace: str, labels: Any, body: Any, **_: Any) -> dict[Key, dict[str, Any]]:
        return {(namespace, labels[naming.LABEL_RUN]): slim_pod(body)}

    def keep_indexes(kwargs: dict[str, Any]) -> None:
        if state.indexes is None:
            state.indexes = {k: kwargs[k] for k in ("runs", "jobs", "pods")}

    @kopf.on.event(*RUNS, registry=registry)
    async def run_event(type: str, namespace: str, name: str, **kwargs: Any) -> None:
        keep_indexes(kwargs)
        if type == "DELETED":
            state.forget((namespace, name))  # children go with it (ownerReferences); checkpoints stay
            return
        state.enqueue((namespace, name))

    @kopf.on.event(*JOBS, labels=CHILD_FILTER, registry=registry)
    async def job_event(type: str, namespace: str, name: str, labels: Any, **kwargs: Any) -> None:
        keep_indexes(kwargs)
        if type == "DELETED":
            state.created_jobs.discard((namespace, name))
        state.enqueue((namespace, labels[naming.LABEL_RUN]))

    @kopf.on.event(*PODS, labels=CHILD_FILTER, registry=registry)
    async def pod_event(namespace: str, labels: Any, **kwargs: Any) -> None:
        keep_indexes(kwargs)
        state.enqueue((namespace, labels[naming.LABEL_RUN]))


async def _reconcile_worker(state: OperatorState) -> None:
    """Reconcile queued runs one after another, for ever. A failure is logged; the resync queues the run again."""
    while True:
        await state.acting.wait()
        key = await state.work.get()
        state.queued.discard(key)
        try:
            await reconcile_run(state, key, **state.indexes)
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning(
                "%s/%s: reconcile failed, retrying within %ss: %s",
                key[0],
                key[1],
                state.settings.reconcile_interval_seconds,
                error,
            )
        except Exception:  # noqa: BLE001 - a bug in one run's reconcile must not stop the others
            log.exception(
                "%s/%s: reconcile failed, retrying within %ss",
                key[0],
                key[1],
                state.settings.reconcile_interval_seconds,
            )


async def reconcile_run(
    state: OperatorState, key: Key, *, runs: kopf.Index, jobs: kopf.Index, pods: kopf.Index, **_: Any
) -> None:
    async with state.locks[key]:
        body = next(iter(runs.get(key, [])), None)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        started = time.monotonic()
        try:
            status = merged_status(body.get("status") or {}, state.written.get(key, {}))
            try:
                run = validation.parse(run_document(body), from_server=True)
                if status.get("observedGeneration") != run.metadata.generation:
                    # Once per spec generation (a generation the operator has acted on passed these): credentials in
                    # the trainer's strings, which the CRD cannot see into; and with the operator's own trainer image,
                    # whose built-in classes it knows, a misspelt one is refused now, not after scheduling and an
                    # image pull (a user's image may differ).
                    problems = validation.credential_problems(run) + (
                        validation.component_problems(run) if run.spec.image is None else []
                    )
                    if problems:
                        raise validation.InvalidTrainingRun(problems)
            except validation.InvalidTrainingRun as error:
                await _reject(state, key, body, status, error)
                return
            # Only this run's own jobs: anyone may label a PyTorchJob with the run's name, or give it an owner reference
            # to the run; only the operator signs it. A job under the name of the current attempt that is not the
            # run's is then missing here: creating it finds the name taken (NameConflict), and it is never used.
            owned = [
                j
                for j in jobs.get(key, [])
                if indexes.run_owns_job(j, run.metadata.uid, status, state.settings.signing_key, state.started)
            ]
            observed = reconcile.Observed(
                run=run,
                status=status,
                jobs={j["metadata"]["name"]: j for j in owned},
                pods=list(pods.get(key, [])),
                now=state.clock(),
                keep_failed_attempts=state.settings.keep_failed_attempts,
                warnings=await _pending_warnings(state, key, status),
            )
            plan = reconcile.decide(observed)
            await _carry_out(
                state,
                key,
                run,
                body,
                plan,
                job_uids={name: j["metadata"].get("uid") for name, j in observed.jobs.items()},
            )
            merged = merged_status(status, plan.status)
            state.metrics.phases[key] = merged.get("phase") or "Pending"
            state.metrics.time_breakdowns[key] = merged.get("timeBreakdown") or {}
        finally:
            state.metrics.reconcile_seconds.observe(time.monotonic() - started)


async def _pending_warnings(state: OperatorState, key: Key, status: dict[str, Any]) -> list[dict[str, Any]]:
    """Warning Events about the current attempt's job and pods, once it has been Pending for a while."""
    started = reconcile.parse_time(status.get("attemptStartTime"))
    job_name = status.get("jobName")
    if (
        status.get("phase") != "Pending"
        or not started
        or not job_name
        or (state.clock() - started).total_seconds() < state.settings.pending_events_after_seconds
    ):
        return []
    return [
        e
        for e in await _namespace_warnings(state, key[0])
        if _about_job((e.get("involvedObject") or {}).get("name") or "", job_name)
    ]


async def _namespace_warnings(state: OperatorState, namespace: str) -> list[dict[str, Any]]:
    """A namespace's Warning Events, read at most once per reconcile interval and shared by all its runs: Events
    are not watched (they are the busiest kind there is), and one read per Pending run made a queue of 2,000
    waiting runs send 2,000 LISTs per interval."""

    def fresh() -> Optional[WarningsRead]:
        read = state.warnings.get(namespace)
        return read if read and time.monotonic() - read.at < state.settings.reconcile_interval_seconds else None

    if (read := fresh()) is not None:
        return read.events
    async with state.warnings_locks[namespace]:  # runs that ask meanwhile wait for this read
        if (read := fresh()) is not None:
            return read.events
        try:
            events = await state.client().list("v1", "Event", namespace, fieldSelector="type=Warning", limit="500")
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning("%s: could not read Warning Events: %s", namespace, error)
            events = []
        state.warnings[namespace] = WarningsRead(
            time.monotonic(),
            [
                {
                    "reason": e.get("reason"),
                    "message": e.get("message"),
                    "involvedObject": {k: (e.get("involvedObject") or {}).get(k) for k in ("kind", "name")},
                }
                for e in events
            ],
        )
        return state.warnings[namespace].events


def _about_job(name: str, job_name: str) -> bool:
    return name == job_name or name.startswith(job_name + "-")  # the job, or its pods (<job>-worker-<i>)


async def _carry_out(
    state: OperatorState,
    key: Key,
    run: Optional[api.TrainingRun],
    body: dict[str, Any],
    plan: reconcile.Plan,
    job_uids: Optional[dict[str, str]] = None,
) -> None:
    """Children, suspension, deletions, then status (remembered until the watch shows it), then Events.
    `run` (the parsed spec) is needed only when the plan starts an attempt; `job_uids` (name: uid of the
    run's own jobs) only when it deletes jobs."""
    kube, (namespace, name) = state.client(), key
    if plan.start_attempt:
        assert run is not None
        job_name = naming.job_name(name, plan.start_attempt)
        if not (plan.attempt_cause == "recreate" and (namespace, job_name) in state.created_jobs):
            if not await _create_children(state, key, body, plan, run, job_name):
                return
    if plan.suspend_job:
        await kube.patch(
            "kubeflow.org/v1", "PyTorchJob", namespace, plan.suspend_job, {"spec": {"runPolicy": {"suspend": True}}}
        )
    for job_name in plan.delete_jobs:
        try:  # exactly the job this run owns: the name may belong to someone else's object by now
            await kube.delete("kubeflow.org/v1", "PyTorchJob", namespace, job_name, uid=(job_uids or {}).get(job_name))
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
        written.update({k: v for k, v in plan.status.items() if k in OPERATOR_FIELDS})
        if plan.restart_cause:
            state.metrics.restarts.labels(namespace, name, plan.restart_cause).inc()
    for note in plan.events:
        state.queue_event(body, note)


async def _create_children(
    state: OperatorState, key: Key, body: dict[str, Any], plan: reconcile.Plan, run: api.TrainingRun, job_name: str
) -> bool:
    """Create (or adopt) an attempt's children; False when the plan must wait (refused now or recently)."""
    kube, generation = state.client(), (body.get("metadata") or {}).get("generation")
    held = state.rejections.get(key)
    if held and held.generation == generation and time.monotonic() < held.retry_at:
        return False  # the server refused this spec's children: wait for the backoff or a spec change
    *support, job = builders.children(run, plan.start_attempt, state.settings, plan.resume_from, plan.checkpoint_uri)
    # All at once: in a burst of runs, sending the ConfigMap first put every job behind every run's other
    # create (p50 create->job ~1 s against ~0.5 s). The Kubeflow operator creates pods only after it has seen
    # the job; a pod that finds no ConfigMap yet waits in ContainerCreating until it exists. Status is
    # written only when both exist, so a failure here starts the same attempt again.
    ordered = [job, *support]
    outcomes = await asyncio.gather(*(_ensure(kube, child) for child in ordered), return_exceptions=True)
    if not isinstance(outcomes[0], BaseException):
        state.created_jobs.add((key[0], job_name))
    if outcomes[0] is True:  # the PyTorchJob is new, not adopted
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
        conditions = reconcile.Conditions(
            plan.status.get("conditions") or status.get("conditions") or [],
            reconcile.rfc3339(state.clock()),
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


def _is_refusal(outcome: Any) -> bool:
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
    status = merged_status(body.get("status") or {}, state.written.get(key, {}))
    conditions = reconcile.Conditions(status.get("conditions") or [], reconcile.rfc3339(state.clock()), generation)
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
            events.append(reconcile.Note("Warning", "ChildRejected", message))
    if conflicts:
        message = (
            "; ".join(str(conflict) for _, conflict in conflicts)
            + f"; this run changes and deletes only its own objects: delete or rename "
            f"{'those' if len(conflicts) > 1 else 'it'}, or create the run under another name"
        )[:2000]
        if conditions.set("NameConflict", True, "NotOwned", f"{message} ({retry})"):
            log.warning("%s/%s: %s", key[0], key[1], message)
            events.append(reconcile.Note("Warning", "NameConflict", message))
    if conditions.changed:
        plan = reconcile.Plan(status={"conditions": conditions.as_list()}, events=events)
        await _carry_out(state, key, None, body, plan)


class NotOwned(Exception):
    """A child's name is taken by an object whose controller is not this run."""

    def __init__(self, child: dict[str, Any]):
        super().__init__(
            f"{child['kind']} {child['metadata']['name']} already exists and is not controlled by "
            "this run (left as it is)"
        )


async def _ensure(kube: Kube, child: dict[str, Any]) -> bool:
    """Create a child. If the name exists and this run controls that object, bring it up to date (a PyTorchJob
    is never changed, and must bear this operator's signature); if anyone else does, or no one, raise NotOwned and
    leave it untouched.

    One JSON patch whose first operations test the controller reference: the server applies all of it or
    none (422), so an object that is not the run's is never written, not even between a read and a write,
    and the operator needs no read access to ConfigMaps."""
    try:
        await kube.create(child)
        return True
    except ApiError as error:
        if error.status != 409:
            raise
    meta = child["metadata"]
    operations: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": controller_uid(child)},
        {"op": "test", "path": "/metadata/ownerReferences/0/controller", "value": True},
    ]
    signature = (meta.get("annotations") or {}).get(naming.ANNOTATION_SIGNATURE)
    if signature:  # a PyTorchJob is used as it is: it must be one this operator made (naming.job_signature)
        operations.append(
            {
                "op": "test",
                "path": "/metadata/annotations/" + naming.ANNOTATION_SIGNATURE.replace("~", "~0").replace("/", "~1"),
                "value": signature,
            }
        )
    if child["kind"] != "PyTorchJob":
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


async def _reject(
    state: OperatorState, key: Key, body: dict[str, Any], status: dict[str, Any], error: validation.InvalidTrainingRun
) -> None:
    """A spec the CRD let through but the operator cannot run: say why, create nothing, wait for a fix."""
    message = "; ".join(str(p) for p in error.problems)[:2000]
    conditions = reconcile.Conditions(
        status.get("conditions") or [], reconcile.rfc3339(state.clock()), (body.get("metadata") or {}).get("generation")
    )
    if conditions.set("SpecRejected", True, "InvalidSpec", message):
        plan = reconcile.Plan(
            status={"conditions": conditions.as_list()}, events=[reconcile.Note("Warning", "SpecRejected", message)]
        )
        await _carry_out(state, key, None, body, plan)


#: Events queued at most; past that (the API server far behind) they are logged, counted and not posted.
EVENT_SENDERS = 2


async def _post_events(state: OperatorState) -> None:
    """Post queued Events, for ever; a failure to post one is logged, never fatal."""
    while True:
        event = await state.events.get()
        about = event["involvedObject"]
        try:
            await state.client().create(event, priority=kube_module.EVENT)
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning(
                "could not post Event %s on %s/%s: %s", event["reason"], about["namespace"], about["name"], error
            )
        else:
            log.info("%s/%s: %s: %s", about["namespace"], about["name"], event["reason"], event["message"])


async def _resync(state: OperatorState) -> None:
    """Every run, every reconcile interval, even without events: backoffs end, stalls are found and a
    reconcile that failed on an API error is retried. One loop, not a kopf timer per run: no
    per-object task and no finalizer, so deleting a run never waits for the operator."""
    while True:
        await asyncio.sleep(state.settings.reconcile_interval_seconds)
        if state.indexes is None or not state.acting.is_set():
            continue  # no run seen yet, or another replica acts
        for key in list(state.indexes["runs"].keys()):
            state.enqueue(key)


async def _follow_peering(state: OperatorState) -> None:
    await state.logged_in.wait()
    await leadership.follow(
        lambda path: state.client().request("GET", path),
        leadership.peering_paths(state.settings.peering, state.settings.namespaces),
        state.identity,
        state.priority,
        state.acting,
        on_change=lambda acting: state.metrics.acting.set(1 if acting else 0),
    )


async def run_operator(
    state: OperatorState, *, stop_flag: Optional[asyncio.Future] = None, ready_flag: Optional[asyncio.Event] = None
) -> None:
    """The whole operator in the current event loop (the CLI and the tests both use this)."""
    registry = kopf.OperatorRegistry()
    register(registry, state)
    settings = state.settings
    if stop_flag is None:
        stop_flag = asyncio.get_running_loop().create_future()
    state.stop = stop_flag
    await kopf.operator(
        registry=registry,
        standalone=not settings.peering,
        peering_name=settings.peering or None,
        identity=state.identity,
        priority=state.priority,
        namespaces=list(settings.namespaces),
        clusterwide=not settings.namespaces,
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
