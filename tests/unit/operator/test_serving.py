"""The replica that acts makes the report Service's EndpointSlice, pointed at its own pod; a standby writes nothing."""

import asyncio
import logging
from types import SimpleNamespace

import kubernetes_validate

from trainingrun_operator import serving
from trainingrun_operator.runtime.kube import ApiError
from trainingrun_operator.settings import Settings

SETTINGS = Settings(report_service="ops/tr-report", report_port=8443, pod_ip="10.244.0.9", pod_name="tr-op-abc")
SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "tr-report", "namespace": "ops", "uid": "svc-1"},
    "spec": {"ports": [{"name": "report", "port": 8443, "targetPort": 8443, "protocol": "TCP"}]},
}


class Client:
    def __init__(self, *failures):
        self.failures, self.applied, self.done = list(failures), [], asyncio.Event()

    async def get(self, api_version, kind, namespace, name):
        assert (api_version, kind, namespace, name) == ("v1", "Service", "ops", "tr-report")
        if self.failures:
            raise self.failures.pop(0)
        return SERVICE

    async def apply(self, obj):
        self.applied.append(obj)
        self.done.set()


def state_of(client, acting):
    state = SimpleNamespace(settings=SETTINGS, logged_in=asyncio.Event(), acting=asyncio.Event(), client=lambda: client)
    state.logged_in.set()
    if acting:
        state.acting.set()
    return state


def test_the_slice_is_valid_owned_by_the_service_and_names_this_pod_alone():
    endpoint_slice = serving.report_endpoint_slice(SETTINGS, SERVICE)
    kubernetes_validate.validate(endpoint_slice, "1.33", strict=True)  # what GitOps pipelines check
    meta = endpoint_slice["metadata"]
    assert (meta["namespace"], meta["name"]) == ("ops", "tr-report-acting")
    assert meta["labels"]["kubernetes.io/service-name"] == "tr-report"  # kube-proxy routes the Service by it
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Service", "name": "tr-report", "uid": "svc-1"}]
    assert endpoint_slice["endpoints"] == [
        {
            "addresses": ["10.244.0.9"],
            "conditions": {"ready": True},
            "targetRef": {"kind": "Pod", "namespace": "ops", "name": "tr-op-abc"},
        }
    ]
    assert endpoint_slice["ports"] == [{"name": "report", "port": 8443, "protocol": "TCP"}]
    assert endpoint_slice["addressType"] == "IPv4"
    ipv6 = Settings(report_service="ops/tr-report", pod_ip="fd00::7")
    assert serving.report_endpoint_slice(ipv6, SERVICE)["addressType"] == "IPv6"


def test_a_standby_writes_nothing_until_it_acts_and_then_the_slice_names_its_pod():
    async def scenario():
        client = Client()
        state = state_of(client, acting=False)
        task = asyncio.create_task(serving.publish_report_endpoint(state, check_seconds=0.01))
        await asyncio.sleep(0.05)
        assert client.applied == []
        state.acting.set()
        await asyncio.wait_for(client.done.wait(), 5)
        assert client.applied == [serving.report_endpoint_slice(SETTINGS, SERVICE)]
        # it stops acting and acts again (another replica acted meanwhile): it points the slice back at once
        state.acting.clear()
        await asyncio.sleep(0.05)
        client.done.clear()
        state.acting.set()
        await asyncio.wait_for(client.done.wait(), 5)
        assert len(client.applied) == 2
        task.cancel()

    asyncio.run(scenario())


def test_a_missing_service_is_said_once_and_tried_again(caplog):
    async def scenario():
        missing = ApiError(404, "NotFound", 'services "tr-report" not found')
        client = Client(missing, missing, missing)
        task = asyncio.create_task(serving.publish_report_endpoint(state_of(client, acting=True), check_seconds=0.01))
        await asyncio.wait_for(client.done.wait(), 5)
        task.cancel()
        return client

    with caplog.at_level(logging.INFO, logger="trainingrun.operator"):
        client = asyncio.run(scenario())
    assert len(client.applied) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "ops/tr-report" in errors[0] and "install or upgrade it again" in errors[0]
    assert any("reports reach this replica" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- which pods may report (run_view)


def test_a_jobset_attempts_pods_may_report_through_the_job_its_jobset_controls_and_no_other(minimal_body):
    """A JobSet's pods are controlled by its Job, not by the JobSet: the report endpoint accepts a pod controlled by a
    Job the attempt's JobSet controls (by uid), and refuses one whose Job anyone else made, labels and all."""
    import json

    import pytest

    from trainingrun_operator import backends, reports
    from trainingrun_operator.indexes import slim_job, slim_part, slim_pod, slim_run
    from trainingrun_operator.report_callers import Caller, Refused
    from trainingrun_operator.runtime.informer import Index
    from trainingrun_operator.state import OperatorState

    run_uid = minimal_body["metadata"]["uid"]
    body = {**minimal_body, "spec": {**minimal_body["spec"], "backend": "JobSet"}}
    status = {"phase": "Running", "attempt": 1, "jobName": "demo-a1", "checkpointUri": "s3://bucket/runs/demo",
              "backend": "JobSet"}  # fmt: skip
    state = OperatorState(settings=Settings())
    state.backends = backends.choose(Settings(), ("PyTorchJob", "JobSet"))
    key = ("team-a", "demo")
    state.runs[key] = slim_run({**json.loads(json.dumps(body)), "status": status})
    state.indexes = {"pods": Index(), "parts": Index(), "PyTorchJob": Index(), "JobSet": Index()}

    def owned(name, uid, owner):
        return {"metadata": {"name": name, "uid": uid, "ownerReferences": [{"uid": owner, "controller": True}]}}

    state.indexes["JobSet"].put(key, "demo-a1", slim_job(owned("demo-a1", "js-uid", run_uid), backends.JOBSET))
    state.indexes["parts"].put(
        key, "demo-a1-worker-0", slim_part(owned("demo-a1-worker-0", "job-uid", "js-uid"), backends.JOBSET.part[2])
    )
    state.indexes["parts"].put(
        key, "planted", slim_part(owned("planted", "planted-uid", "someone"), backends.JOBSET.part[2])
    )
    for name, uid, controller in (
        ("demo-a1-worker-0-0-abcde", "p0", "job-uid"),
        ("demo-a1-worker-0-1-fghij", "p1", "planted-uid"),
    ):
        pod = owned(name, uid, controller)
        pod["metadata"]["labels"] = {"trainingrun.dev/attempt": "1"}
        state.indexes["pods"].put(key, name, slim_pod(pod))  # fmt: skip

    view = serving.run_view(state, *key)
    assert view.pod_controllers == frozenset({"job-uid"}) and view.job_kind == "JobSet"
    reports.check_pod(Caller("team-a", "default", "demo-a1-worker-0-0-abcde", "p0"), view)
    with pytest.raises(Refused, match=r"not a pod of attempt 1 \(JobSet demo-a1\)"):
        reports.check_pod(Caller("team-a", "default", "demo-a1-worker-0-1-fghij", "p1"), view)
