"""kube.py against a real API server: a list follows the server's continue token, and stops at its bound."""

import kopf
import pytest
import yaml

from trainingrun_operator.kube import Kube


def warning_event(namespace: str, pod: str, reason: str = "FailedScheduling", kind: str = "Warning") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod}.17f0c0ffee", "namespace": namespace},
        "involvedObject": {"kind": "Pod", "name": pod, "namespace": namespace},
        "reason": reason,
        "message": "0/1 nodes are available",
        "type": kind,
    }


@pytest.mark.asyncio
async def test_a_list_reads_every_page_up_to_its_bound(kube_cluster_session, kube_namespace):
    """The first page of a namespace's Warning Events held only the names that sort first: a run whose pods sort
    after them never learned why it waited."""
    plane, namespace = kube_cluster_session, kube_namespace
    pods = [f"run-{i:03d}-worker-0" for i in range(120)]
    events = [warning_event(namespace, pod) for pod in pods] + [
        warning_event(namespace, "zz-other", "Pulled", "Normal")
    ]
    plane.kubectl("create", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": events}))
    pki = plane.pki
    kube = Kube(
        kopf.ConnectionInfo(
            server=plane.server,
            ca_path=str(pki / "ca.crt"),
            certificate_path=str(pki / "admin.crt"),
            private_key_path=str(pki / "admin.key"),
        )
    )
    try:
        found, complete = await kube.list("v1", "Event", namespace, page_size=50, fieldSelector="type=Warning")
        assert complete and sorted(e["involvedObject"]["name"] for e in found) == pods  # 3 pages, Normal left out
        found, complete = await kube.list("v1", "Event", namespace, page_size=50, most=70, fieldSelector="type=Warning")
        assert not complete and [e["involvedObject"]["name"] for e in found] == pods[:70]
    finally:
        await kube.close()
