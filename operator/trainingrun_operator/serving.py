"""The operator's HTTP servers: /metrics and /readyz, and the trainers' report endpoint (reports.py) wired to
the indexes and to status; the readiness check they answer from; and, on the replica that acts, the report
Service's EndpointSlice pointed at this pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from . import api, report_callers, reports
from .indexes import SPEC_JSON, controller_uid, merged_status, run_owns_job, spec_problem
from .runtime.kube import STATUS, ApiError
from .state import Key, OperatorState

if TYPE_CHECKING:
    from .backends import Backend
    from .settings import Settings

log = logging.getLogger("trainingrun.operator")


def crd_missing(backend: "Backend", auto: bool = False) -> str:
    """What to install, and (backend auto, nothing served at start) the other way: JobSet, then a restart."""
    from .backends import JOBSET

    other = (
        f" (or, without Kubeflow, {JOBSET.install}, then restart the operator: with backend auto it runs JobSets "
        "when only those are served)"
        if auto and backend is not JOBSET
        else ""
    )
    return (
        f"the {backend.kind} CRD ({backend.api_version}) is not served: {backend.install}{other}; until then "
        "TrainingRuns wait and /readyz answers 503"
    )


async def watch_crd(state: OperatorState) -> None:
    """Readiness: whether the CRD of the operator's default backend is served (backends.Choice; before the operator
    has chosen, with backend auto, whether any backend's is), checked at start and then periodically. Each change of
    the answer (served, not served, API unreachable) is logged once, saying what to do."""
    from .backends import BACKENDS

    await state.logged_in.wait()
    said: Optional[str] = None
    auto = state.settings.backend == "auto"
    while True:
        served, backend = False, state.backends.default
        candidates = [backend] if state.backends_chosen.is_set() or not auto else list(BACKENDS.values())
        named = " or ".join(f"the {b.kind} CRD ({b.api_version})" for b in candidates)
        try:
            for candidate in candidates:
                if await state.client().serves(candidate.api_version, candidate.plural):
                    served, named = True, f"the {candidate.kind} CRD ({candidate.api_version})"
                    break
            answer, line = (
                ("served", f"{named} is served: ready") if served else ("missing", crd_missing(backend, auto))
            )
        except ApiError as error:
            answer, line = "refused", f"the Kubernetes API answered the check of {named} with {error}; not ready"
        except (OSError, asyncio.TimeoutError) as error:
            answer, line = (
                "unreachable",
                (
                    f"cannot reach the Kubernetes API at {state.api_server} ({error}); not "
                    "ready until it answers: check the cluster address and the network policy"
                ),
            )
        state.ready = served
        state.metrics.ready.set(1 if served else 0)
        if answer != said:
            (log.info if served else log.error)(line)
            said = answer
        await asyncio.sleep(state.settings.crd_check_seconds)


async def serve_metrics(state: OperatorState) -> None:
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=state.metrics.exposition(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def ready(request: web.Request) -> web.Response:
        if state.ready:
            return web.Response(text="ready\n")
        text = crd_missing(state.backends.default, state.settings.backend == "auto")
        return web.Response(status=503, text=text + "\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/readyz", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", state.settings.metrics_port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_view(state: OperatorState, namespace: str, name: str) -> Optional[reports.RunView]:
    """The report endpoint's view of one run, from the indexes (no API reads): None when it is not active."""
    if state.indexes is None:
        return None
    key = (namespace, name)
    body = state.runs.get(key)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = merged_status(body.get("status") or {}, state.written.get(key, {}))
    uid, job_name = body["metadata"].get("uid"), status.get("jobName")
    if status.get("phase") not in ("Pending", "Running") or not job_name or not status.get("checkpointUri"):
        return None
    if spec_problem(body):
        return None  # a spec the operator did not keep (indexes.slim_run): the run is stopped, its reports refused
    spec = json.loads(body[SPEC_JSON])  # read once per report: the backend and the stall timeout
    backend = state.backends.of(spec.get("backend"), status)
    job = next(
        (
            j
            for j in (state.indexes.get(backend.kind) or {}).get(key, [])
            if j["metadata"].get("name") == job_name
            and run_owns_job(j, uid, status, state.settings.signing_key, state.started, state.made_jobs)
        ),
        None,
    )
    # Pods are controlled by the job (Kubeflow's), or by a part the job controls (a JobSet's Job).
    job_uid = job["metadata"].get("uid") if job else None
    controllers = (
        frozenset(
            p["metadata"]["uid"]
            for p in state.indexes["parts"].get(key, [])
            if job_uid and controller_uid(p) == job_uid
        )
        if backend.part
        else frozenset({job_uid} if job_uid else ())
    )
    recovery = spec.get("recovery") or {}
    return reports.RunView(
        uid=uid,
        attempt=int(status.get("attempt") or 0),
        job_name=job_name,
        checkpoint_uri=status["checkpointUri"],
        status=status,
        pods=list(state.indexes["pods"].get(key, [])),
        pod_controllers=controllers,
        stall_timeout_seconds=int(recovery.get("stallTimeoutSeconds", DEFAULT_STALL_TIMEOUT)),
        job_kind=backend.kind,
    )


def known_pod(state: OperatorState, pod: report_callers.ClaimedPod) -> bool:
    """Whether a token's claimed pod is a worker pod of a run, by the operator's index (no API reads): its name says
    which run (`<run>-a<attempt>-worker-<i>`), and name and uid must match a pod the index holds for that run."""
    if state.indexes is None:
        return False
    run, _, _ = pod.name.rpartition("-worker-")
    run = run.rpartition("-a")[0]
    return any(
        (p.get("metadata") or {}).get("name") == pod.name and (p.get("metadata") or {}).get("uid") == pod.uid
        for p in state.indexes["pods"].get((pod.namespace, run), [])
    )


#: What the API server fills in when spec.recovery.stallTimeoutSeconds is absent (the CRD's default).
DEFAULT_STALL_TIMEOUT = api.Recovery.model_fields["stall_timeout_seconds"].default


async def write_reported_status(state: OperatorState, key: Key, fields: dict[str, Any]) -> None:
    await state.client().patch(
        api.API_VERSION, api.KIND, key[0], key[1], {"status": fields}, subresource="status", priority=STATUS
    )


async def accept_report(
    state: OperatorState, writes: reports.CoalescedWrites, key: Key, fields: dict[str, Any], at_once: bool = False
) -> None:
    """Status from a report: the operator's view of the run has it at once (the next report and reconcile see it);
    the API server gets it at most every STATUS_WRITE_SECONDS (`writes`), a run training again at once."""
    state.written.setdefault(key, {}).update(fields)
    await writes.submit(key, fields, at_once=at_once)


#: The replica that acts applies its report EndpointSlice again this often, undoing any other change to it.
REPUBLISH_SECONDS = 30.0
#: The report Service's EndpointSlice is named after it with this suffix (the chart's Role names that one slice).
ENDPOINT_SLICE_SUFFIX = "-acting"


def report_endpoint_slice(settings: Settings, service: dict[str, Any]) -> dict[str, Any]:
    """The EndpointSlice that sends the report Service's traffic to this pod alone, owned by that Service (the
    garbage collector removes it with the Service). The operator makes it, not the chart: a slice without
    endpoints is invalid in the published schema, and one with them would be reset by every `helm upgrade`."""
    meta = service["metadata"]
    endpoint: dict[str, Any] = {"addresses": [settings.pod_ip], "conditions": {"ready": True}}
    if settings.pod_name:
        endpoint["targetRef"] = {"kind": "Pod", "namespace": meta["namespace"], "name": settings.pod_name}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": meta["name"] + ENDPOINT_SLICE_SUFFIX,
            "namespace": meta["namespace"],
            "labels": {
                "kubernetes.io/service-name": meta["name"],
                "endpointslice.kubernetes.io/managed-by": "trainingrun-operator",
            },
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta["uid"]}],
        },
        "addressType": "IPv6" if ":" in settings.pod_ip else "IPv4",
        "ports": [{"name": "report", "port": settings.report_port, "protocol": "TCP"}],  # where this pod listens
        "endpoints": [endpoint],
    }


async def publish_report_endpoint(state: OperatorState, check_seconds: float = 1.0) -> None:
    """While this replica acts, the report Service routes to it alone: a standby's indexes are frozen by kopf's
    peering, so it could only refuse. A replica that stands by writes nothing; the next to act applies the
    slice again, naming itself."""
    await state.logged_in.wait()
    namespace, service_name = state.settings.report_service.split("/", 1)
    said, published_at = "", None
    while True:
        if not state.acting.is_set():
            published_at, said = None, ""
            await state.acting.wait()
        if published_at is None or time.monotonic() - published_at >= REPUBLISH_SECONDS:
            try:
                service = await state.client().get("v1", "Service", namespace, service_name)
                await state.client().apply(report_endpoint_slice(state.settings, service))
            except (ApiError, OSError, asyncio.TimeoutError) as error:
                line = (
                    f"cannot point the report Service {namespace}/{service_name} at this replica ({error}); "
                    "trainers' reports wait until it can"
                )
                if isinstance(error, ApiError) and error.status == 404:
                    line += ": the chart makes that Service, install or upgrade it again"
                if line != said:
                    log.error(line)
                    said = line
                await asyncio.sleep(5 * check_seconds)
                continue
            published_at = time.monotonic()
            if said != "published":
                log.info(
                    "reports reach this replica: EndpointSlice %s/%s%s -> %s",
                    namespace,
                    service_name,
                    ENDPOINT_SLICE_SUFFIX,
                    state.settings.pod_ip,
                )
                said = "published"
        await asyncio.sleep(check_seconds)


async def serve_reports(state: OperatorState) -> None:
    await state.logged_in.wait()
    settings = state.settings
    writes = reports.CoalescedWrites(
        lambda key, fields: write_reported_status(state, key, fields), reports.STATUS_WRITE_SECONDS
    )
    endpoint = reports.ReportEndpoint(
        report_callers.TokenReviewer(
            state.client, settings.report_token_cache_seconds, known_pod=lambda pod: known_pod(state, pod)
        ),
        view=lambda namespace, name: run_view(state, namespace, name),
        accept=lambda key, fields, at_once=False: accept_report(state, writes, key, fields, at_once),
        clock=state.clock,
        acting=state.acting.is_set,
        limits=settings.report_limits(),
        on_closed=lambda reason: state.metrics.report_connections_closed.labels(reason).inc(),
    )
    https = settings.report_url.startswith("https://")
    await reports.serve(endpoint, settings.report_port, settings.report_tls_dir if https else None)
