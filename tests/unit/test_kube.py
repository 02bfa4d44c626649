"""API paths for the kinds the operator writes, and the order its requests go out in."""

import pytest

from trainingrun_operator.kube import collection_path, object_path


def test_paths():
    assert collection_path("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    assert collection_path("kubeflow.org/v1", "PyTorchJob", "ns") == "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs"
    assert (
        object_path("trainingrun.dev/v1alpha1", "TrainingRun", "ns", "demo", "status")
        == "/apis/trainingrun.dev/v1alpha1/namespaces/ns/trainingruns/demo/status"
    )
    assert (
        object_path("rbac.authorization.k8s.io/v1", "Role", "ns", "r")
        == "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r"
    )


@pytest.mark.asyncio
async def test_the_gate_lets_waiters_in_by_priority_then_in_order():
    """Children of new attempts before status writes before Events, whatever order they asked in."""
    import asyncio

    from trainingrun_operator.kube import ACT, EVENT, STATUS, PriorityGate

    gate = PriorityGate(1)
    await gate(ACT)  # the one place is taken
    order = []

    async def wait(label, priority):
        await gate(priority)
        order.append(label)
        gate.release()

    waiters = [
        asyncio.create_task(wait(label, priority))
        for label, priority in (("event", EVENT), ("status 1", STATUS), ("child", ACT), ("status 2", STATUS))
    ]
    await asyncio.sleep(0)  # all four are waiting
    assert order == [] and gate.holders == 1
    gate.release()
    await asyncio.gather(*waiters)
    assert order == ["child", "status 1", "status 2", "event"]
    assert gate.holders == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_gives_its_place_back():
    import asyncio

    from trainingrun_operator.kube import ACT, PriorityGate

    gate = PriorityGate(1)
    await gate(ACT)
    cancelled = asyncio.create_task(gate(ACT))
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.release()  # would hand the place to the cancelled waiter
    await asyncio.gather(cancelled, return_exceptions=True)
    assert gate.holders == 0
    await asyncio.wait_for(gate(ACT), 1)  # the place is free
    assert gate.holders == 1


@pytest.mark.asyncio
async def test_a_list_answered_with_empty_pages_stops_after_a_bounded_number_of_requests():
    """The API may answer a page with no items and a continue token (a field selector applied after the page was
    read); a namespace full of Events must not cost a request per page without bound."""
    from trainingrun_operator.kube import Kube

    class EmptyPages(Kube):
        def __init__(self):
            self.asked: list[str] = []

        async def request(self, method, path, body=None, **kwargs):
            self.asked.append(path)
            return {"items": [], "metadata": {"continue": f"token-{len(self.asked)}"}}

    kube = EmptyPages()
    assert await kube.list("v1", "Event", "ns", fieldSelector="type=Warning") == ([], False)
    assert len(kube.asked) == 16  # four times the 4 pages of 500 that most=2000 fills
    assert "continue=token-15" in kube.asked[-1]
    kube.asked.clear()
    assert await kube.list("v1", "Event", "ns", pages=2) == ([], False) and len(kube.asked) == 2
