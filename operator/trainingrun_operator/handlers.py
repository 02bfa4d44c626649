"""The operator's triggers and reconcile workers: keep the runs (state.runs) and the jobs and pods of each
(state.indexes) from the operator's own watches (runtime/informer.py), and reconcile on any change. kopf logs in, runs
peering (runtime/leadership.py), the liveness endpoint, and calls the startup and cleanup handlers here.

Every trigger (a TrainingRun event, an event of a job (PyTorchJob or JobSet), its parts or its pods, a recheck: runtime/rechecks.py) queues the run's key;
a fixed number of workers take keys from the queue and run the same level-triggered `reconcile_run`: read
the run and its children from the indexes (no API reads), let `reconcile.decide` choose, then
create/patch/delete what the plan says and write status. A key already queued is not queued again: the
worker reads the indexes when it starts, so it sees every change that queued it. The event functions only
keep and queue, so watching is never held up by API calls.
Handlers stay thin; decisions are in reconcile.py, objects in builders.py, carrying out a plan in plans.py, API
calls in runtime/kube.py.

Runs are reconciled one at a time per run (a lock each), and the status fields the operator owns
are taken from its own last write until the watch delivers it, so two quick triggers can never
charge one failure twice or start an attempt twice. Everything else survives a restart in status.

What the indexes keep is in indexes.py, what the process keeps in memory in state.py, the HTTP servers (metrics,
readiness, reports) in serving.py, which replica acts in runtime/leadership.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable, Optional

import kopf

from . import api, backends, indexes, naming, plans, reconcile, serving, validation
from .backends import Backend
from .indexes import merged_status, run_document, slim_job, slim_part, slim_pod, slim_run
from .problems import Problem
from .runtime import kube as kube_module
from .runtime import leadership
from .runtime.informer import Index, Informer
from .runtime.kube import ApiError
from .state import Key, OperatorState, Reconciled

log = logging.getLogger("trainingrun.operator")


def register(registry: kopf.OperatorRegistry, state: OperatorState) -> None:
    """Add the operator's handlers to `registry`, bound to `state`."""

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # No resource handler is kopf's (the operator watches with runtime/informer.py), so kopf keeps no progress
        # or diff-base of any object: its persistence settings would act on nothing.
        settings.posting.enabled = False  # Events are the operator's own, never copies of log lines
        settings.peering.name = state.settings.peering or "trainingrun-operator"
        settings.peering.lifetime = state.settings.peering_lifetime_seconds
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
        state.tasks.append(
            asyncio.create_task(state.rechecks.run(state.recheck_ready, state.runs.keys), name="trainingrun-rechecks")
        )
        state.tasks.append(asyncio.create_task(_inform(state), name="trainingrun-inform"))
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

    @kopf.on.startup(registry=registry, id="tasks-say-why-they-end")
    async def say_why_tasks_end(**_: Any) -> None:
        for task in state.tasks:
            task.add_done_callback(_log_crash)

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

    @kopf.on.probe(registry=registry, id="watches")
    async def watching(**_: Any) -> str:
        # kopf's /healthz answers 500 when a probe fails for good: Kubernetes then restarts a blind operator.
        blind = state.blind_watches()
        if blind:
            raise kopf.PermanentError("; ".join(blind))
        return f"{len(state.watches)} watching"

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in state.tasks:
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)
        if state.kube is not None:
            await state.kube.close()


def _log_crash(task: asyncio.Task) -> None:
    """A task of the operator that ended with an error (a bug): logged, else it ends without a word; the liveness
    probe says so for the watches (state.blind_watches)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %r", task.get_name(), task.exception(), exc_info=task.exception())


def run_event(state: OperatorState, type: str, body: dict[str, Any]) -> None:
    """A run's watch event: keep it (state.runs), and queue it unless it shows only what its last reconcile wrote."""
    meta = body.get("metadata") or {}
    key = (str(meta.get("namespace")), str(meta.get("name")))
    if type == "DELETED":
        state.forget(key)  # children go with it (ownerReferences); checkpoints stay
        return
    run = state.runs[key] = slim_run(body, state.runs.get(key))
    written = state.written.get(key, {})
    seen = key in state.reconciled and state.reconciled[key].run == indexes.view(
        run, merged_status(run["status"], written)
    )
    indexes.forget_shown(written, run["status"])
    if not written:
        state.written.pop(key, None)
    if not seen:  # else it only shows what its last reconcile wrote: deciding again would change nothing
        state.enqueue(key)


def job_event(state: OperatorState, type: str, body: dict[str, Any], *, backend: Backend) -> None:
    """A job's watch event (a PyTorchJob, a JobSet): keep it, and queue its run unless its jobs are as its last
    reconcile left them (e.g. the one it created, as it sent it)."""
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    key = _labelled_run(meta)
    assert state.indexes is not None
    jobs = state.indexes[backend.kind]
    jobs.put(key, name, None if type == "DELETED" else slim_job(body, backend))
    if type == "DELETED":
        state.created_jobs.discard((namespace, name))
    left = state.reconciled.get(key)
    if left is None or left.jobs != indexes.jobs_view(jobs.get(key, [])):
        state.enqueue(key)


def part_event(state: OperatorState, type: str, body: dict[str, Any], *, backend: Backend) -> None:
    """The watch event of a part of a job (a JobSet's Job): keep it, and queue its run."""
    assert state.indexes is not None and backend.part is not None
    meta = body.get("metadata") or {}
    key = _labelled_run(meta)
    slim_status = backend.part[2]
    state.indexes["parts"].put(key, str(meta.get("name")), None if type == "DELETED" else slim_part(body, slim_status))
    state.enqueue(key)


def pod_event(state: OperatorState, type: str, body: dict[str, Any]) -> None:
    """A worker pod's watch event: keep it, and queue its run."""
    meta = body.get("metadata") or {}
    key = _labelled_run(meta)
    assert state.indexes is not None
    state.indexes["pods"].put(key, str(meta.get("name")), None if type == "DELETED" else slim_pod(body))
    state.enqueue(key)


def _labelled_run(meta: dict[str, Any]) -> Key:
    """The run a job or pod is labelled with (informers watch only those with the label)."""
    return str(meta.get("namespace")), str((meta.get("labels") or {}).get(naming.LABEL_RUN))


async def _inform(state: OperatorState) -> None:
    """Choose the backends (backends.choose), then list and watch runs, the jobs of each backend used (and their
    parts) and pods (informer.py): in every watched namespace, or cluster-wide. The reconcile workers wait until
    every kind was listed once, so a restarted operator never reconciles a run before its jobs are known (it would
    create them again)."""
    await state.logged_in.wait()
    state.backends = await _choose_backends(state)
    state.backends_chosen.set()
    state.indexes = {"pods": Index(), "parts": Index(), **{b.kind: Index() for b in state.backends.usable}}
    selector = naming.LABEL_RUN
    namespaces: list[Optional[str]] = list(state.settings.namespaces) or [None]
    Handler = Callable[[OperatorState, str, dict[str, Any]], None]
    kinds: list[tuple[str, str, str, Handler]] = [(api.API_VERSION, api.KIND, "", run_event)]
    for backend in state.backends.usable:
        kinds.append((backend.api_version, backend.kind, selector, functools.partial(job_event, backend=backend)))
        if backend.part is not None:
            kinds.append((backend.part[0], backend.part[1], selector, functools.partial(part_event, backend=backend)))
    kinds.append(("v1", "Pod", selector, pod_event))
    listed: list[asyncio.Event] = []
    informers: list[asyncio.Task] = []
    for api_version, kind, labels, handler in kinds:
        for namespace in namespaces:
            listed.append(asyncio.Event())
            informer = Informer(
                state.client,
                kube_module.collection_path(api_version, kind, namespace),
                functools.partial(handler, state),
                labels,
                on_skipped=functools.partial(_skipped, state, kind),
            )
            informers.append(asyncio.create_task(informer.run(listed[-1]), name=f"trainingrun-watch-{kind}"))
            state.watches.append((informer, informers[-1]))
    try:
        await asyncio.gather(*(d.wait() for d in listed))
        state.informed.set()
        await asyncio.gather(*informers)
    finally:
        for task in informers:
            task.cancel()
        await asyncio.gather(*informers, return_exceptions=True)


def _skipped(state: OperatorState, kind: str, body: dict[str, Any], error: Exception) -> None:
    """An object the operator could not read (the informer logged it and goes on): counted; a run is kept as refused,
    so it gets the SpecRejected condition that says so, and is never run as it was before."""
    state.metrics.objects_skipped.labels(kind).inc()
    meta = body.get("metadata") or {}
    if kind != api.KIND or not isinstance(meta.get("name"), str) or not isinstance(meta.get("namespace"), str):
        return
    key = (meta["namespace"], meta["name"])
    problem = f"the operator could not read this run ({type(error).__name__}); see its log"
    state.runs[key] = indexes.refused_run(meta, problem, (state.runs.get(key) or {}).get("status") or {})
    state.enqueue(key)


async def _choose_backends(state: OperatorState) -> backends.Choice:
    """The backends this operator runs (backends.choose): with `auto`, those whose CRD the API server serves now
    (discovery, which needs no RBAC), asked until it answers."""
    if state.settings.backend != "auto":
        return backends.choose(state.settings, ())
    while True:
        try:
            served = [
                b.kind for b in backends.BACKENDS.values() if await state.client().serves(b.api_version, b.plural)
            ]
        except (ApiError, OSError, asyncio.TimeoutError) as error:  # readiness says so (serving.watch_crd)
            log.debug("could not ask the API server which backends it serves, asking again in 5 s: %s", error)
            await asyncio.sleep(5)
            continue
        choice = backends.choose(state.settings, served)
        log.info(
            "backend auto: runs without spec.backend become %ss; runs may use %s (served at start)",
            choice.default.kind,
            ", ".join(b.kind for b in choice.usable),
        )
        return choice


async def _reconcile_worker(state: OperatorState) -> None:
    """Reconcile queued runs one after another, for ever. A failure is logged; the resync queues the run again."""
    await state.informed.wait()
    while True:
        await state.acting.wait()
        key = await state.work.get()
        state.queued.discard(key)
        assert state.indexes is not None  # keys are queued by events and the resync, after the indexes are kept
        retry_in = state.settings.reconcile_interval_seconds
        try:
            await reconcile_run(state, key)
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning("%s/%s: reconcile failed, retrying in %ss: %s", key[0], key[1], retry_in, error)
            state.rechecks.at(key, time.monotonic() + retry_in)
        except Exception:  # noqa: BLE001 - a bug in one run's reconcile must not stop the others
            log.exception("%s/%s: reconcile failed, retrying in %ss", key[0], key[1], retry_in)
            state.rechecks.at(key, time.monotonic() + retry_in)


async def reconcile_run(state: OperatorState, key: Key) -> None:
    assert state.indexes is not None
    async with state.locks[key]:
        state.reconciled.pop(key, None)  # set again below by a reconcile that carries out its whole plan
        body = state.runs.get(key)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        started = time.monotonic()
        try:
            status = merged_status(body.get("status") or {}, state.written.get(key, {}))
            try:
                if problem := indexes.spec_problem(body):
                    raise validation.InvalidTrainingRun([Problem("", problem)])
                run = validation.parse(run_document(body), from_server=True)
                backend = state.backends.of(run.spec.backend, status)
                if problem := state.backends.problem(backend):
                    raise validation.InvalidTrainingRun([Problem("", problem)])
                if status.get("observedGeneration") != run.metadata.generation:
                    # Once per spec generation (a generation the operator has acted on passed these): credentials in
                    # the trainer's strings, which the CRD cannot see into; and with the operator's own trainer image,
                    # whose built-in classes it knows, a misspelt one is refused now, not after scheduling and an
                    # image pull (a user's image may differ).
                    problems = validation.credential_problems(run.spec.trainer) + (
                        validation.component_problems(run.spec.trainer) if run.spec.image is None else []
                    )
                    if problems:
                        raise validation.InvalidTrainingRun(problems)
            except validation.InvalidTrainingRun as error:
                await plans.reject(state, key, body, status, error)
                return
            # Only this run's own jobs: anyone may label a job with the run's name, or give it an owner reference
            # to the run; only the operator signs it. A job under the name of the current attempt that is not the
            # run's is then missing here: creating it finds the name taken (NameConflict), and it is never used.
            jobs, pods = state.indexes[backend.kind], state.indexes["pods"]
            owned = [
                j
                for j in jobs.get(key, [])
                if indexes.run_owns_job(
                    j, run.metadata.uid, status, state.settings.signing_key, state.started, state.made_jobs
                )
            ]
            observed = reconcile.Observed(
                run=run,
                status=status,
                jobs={j["metadata"]["name"]: j for j in owned},
                pods=list(pods.get(key, [])),
                now=state.clock(),
                keep_failed_attempts=state.settings.keep_failed_attempts,
                backend=backend,
                parts=current_parts(state.indexes["parts"].get(key, []), owned, status.get("jobName")),
                warnings=await state.rechecks.pending_warnings(key, status),
            )
            plan = reconcile.decide(observed)
            if plan.recheck_at is not None:
                wait = max(0.0, (plan.recheck_at - observed.now).total_seconds())
                state.rechecks.at(key, time.monotonic() + wait)
            merged = merged_status(status, plan.status)
            if _decides_the_same_after(state, key, observed, plan, merged, list(jobs.get(key, []))):
                # Before the status write: its watch event may come while the write's answer is on its way.
                state.reconciled[key] = Reconciled(
                    indexes.view(body, merged),
                    indexes.jobs_view(j for j in jobs.get(key, []) if j["metadata"]["name"] not in plan.delete_jobs),
                )
            carried_out = False
            try:
                carried_out = await plans.carry_out(
                    state,
                    key,
                    run,
                    body,
                    plan,
                    job_uids={name: j["metadata"].get("uid") for name, j in observed.jobs.items()},
                )
            finally:
                if not carried_out:
                    state.reconciled.pop(key, None)
            state.metrics.phases[key] = merged.get("phase") or "Pending"
            state.metrics.time_breakdowns[key] = merged.get("timeBreakdown") or {}
        finally:
            state.metrics.reconcile_seconds.observe(time.monotonic() - started)


def current_parts(parts: Any, owned: list[dict[str, Any]], job_name: Optional[str]) -> list[dict[str, Any]]:
    """The parts (a JobSet's Jobs) the current attempt's job controls: by its uid, which only that job has."""
    job = next((j for j in owned if j["metadata"]["name"] == job_name), None)
    uid = (job or {}).get("metadata", {}).get("uid")
    return [p for p in parts if uid and indexes.controller_uid(p) == uid]


def _decides_the_same_after(
    state: OperatorState,
    key: Key,
    observed: reconcile.Observed,
    plan: reconcile.Plan,
    merged: dict[str, Any],
    jobs: list[dict[str, Any]],
) -> bool:
    """Whether a reconcile of the plan's own result would see what this one saw but the status it wrote, so that the
    watch event of that write needs none (decide is idempotent on its own plan). Two inputs are read from status
    here, not in decide: the Warning Events, read only while Pending, and which jobs are the run's (an unsigned job
    its status names); when the plan changes those, the event is reconciled."""
    if observed.warnings and {"phase", "jobName", "attemptStartTime"} & plan.status.keys():
        return False
    if not {"jobName", "attemptStartTime"} & plan.status.keys():
        return True  # what run_owns_job reads of status is unchanged
    owned = {
        j["metadata"]["name"]
        for j in jobs
        if indexes.run_owns_job(
            j, observed.run.metadata.uid, merged, state.settings.signing_key, state.started, state.made_jobs
        )
    }
    return owned == set(observed.jobs)


#: Tasks posting queued Events.
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


async def _follow_peering(state: OperatorState) -> None:
    await state.logged_in.wait()
    await leadership.follow(
        lambda path: state.client().request("GET", path),
        leadership.peering_paths(state.settings.peering, state.settings.namespaces),
        state.identity,
        state.priority,
        state.acting,
        on_change=state.acting_changed,
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
        identity=state.identity,  # type: ignore[arg-type]  # kopf's Identity is a NewType of str it does not export
        priority=state.priority,
        namespaces=list(settings.namespaces),
        clusterwide=not settings.namespaces,
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
