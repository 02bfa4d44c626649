"""The replica that acts points the report Service's EndpointSlice at its own pod; a standby writes nothing."""
import asyncio
import logging
from types import SimpleNamespace

from trainingrun_operator import serving
from trainingrun_operator.kube import ApiError
from trainingrun_operator.settings import Settings

SETTINGS = Settings(report_endpoint_slice="ops/tr-report-acting", pod_ip="10.244.0.9", pod_name="tr-op-abc")
ENDPOINTS = {"endpoints": [{"addresses": ["10.244.0.9"], "conditions": {"ready": True},
                            "targetRef": {"kind": "Pod", "namespace": "ops", "name": "tr-op-abc"}}]}


class Client:
    def __init__(self, *failures):
        self.failures, self.patches, self.patched = list(failures), [], asyncio.Event()

    async def patch(self, api_version, kind, namespace, name, patch):
        if self.failures:
            raise self.failures.pop(0)
        self.patches.append((api_version, kind, namespace, name, patch))
        self.patched.set()


def state_of(client, acting):
    state = SimpleNamespace(settings=SETTINGS, logged_in=asyncio.Event(), acting=asyncio.Event(), client=lambda: client)
    state.logged_in.set()
    if acting:
        state.acting.set()
    return state


def test_a_standby_writes_nothing_until_it_acts_and_then_the_slice_names_its_pod():
    async def scenario():
        client = Client()
        state = state_of(client, acting=False)
        task = asyncio.create_task(serving.publish_report_endpoint(state, check_seconds=0.01))
        await asyncio.sleep(0.05)
        assert client.patches == []
        state.acting.set()
        await asyncio.wait_for(client.patched.wait(), 5)
        assert client.patches == [("discovery.k8s.io/v1", "EndpointSlice", "ops", "tr-report-acting", ENDPOINTS)]
        # it stops acting and acts again (another replica acted meanwhile): it points the slice back at once
        state.acting.clear()
        await asyncio.sleep(0.05)
        client.patched.clear()
        state.acting.set()
        await asyncio.wait_for(client.patched.wait(), 5)
        assert len(client.patches) == 2
        task.cancel()

    asyncio.run(scenario())


def test_a_missing_slice_is_said_once_and_tried_again(caplog):
    async def scenario():
        missing = ApiError(404, "NotFound", 'endpointslices "tr-report-acting" not found')
        client = Client(missing, missing, missing)
        task = asyncio.create_task(serving.publish_report_endpoint(state_of(client, acting=True), check_seconds=0.01))
        await asyncio.wait_for(client.patched.wait(), 5)
        task.cancel()
        return client

    with caplog.at_level(logging.INFO, logger="trainingrun.operator"):
        client = asyncio.run(scenario())
    assert len(client.patches) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "ops/tr-report-acting" in errors[0] and "apply it again" in errors[0]
    assert any("reports reach this replica" in r.getMessage() for r in caplog.records)
