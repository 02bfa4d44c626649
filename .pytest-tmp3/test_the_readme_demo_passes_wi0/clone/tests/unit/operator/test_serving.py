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
