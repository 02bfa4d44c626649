"""kube.py against a real API server: a list follows the server's continue token, and stops at its bound."""

import kopf
import pytest
import yaml

from trainingrun_operator.runtime.kube import AnswerTooLarge, Kube


def warning_event(
    namespace: str, pod: str, reason: str = "FailedScheduling", kind: str = "Warning", message: str = "0/1 nodes fit"
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod}.17f0c0ffee", "namespace": namespace},
        "involvedObject": {"kind": "Pod", "name": pod, "namespace": namespace},
        "reason": reason,
        "message": message,
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
    kube = admin_client(plane)
    try:
        found, complete = await kube.list("v1", "Event", namespace, page_size=50, fieldSelector="type=Warning")
        assert complete and sorted(e["involvedObject"]["name"] for e in found) == pods  # 3 pages, Normal left out
        found, complete = await kube.list("v1", "Event", namespace, page_size=50, most=70, fieldSelector="type=Warning")
        assert not complete and [e["involvedObject"]["name"] for e in found] == pods[:70]
    finally:
        await kube.close()


@pytest.mark.asyncio
async def test_a_page_longer_than_its_reader_holds_is_not_read(kube_cluster_session, kube_namespace):
    """Anyone who may create Events in a namespace writes their messages: a page of large ones fails the read with a
    clear error instead of being held."""
    plane, namespace = kube_cluster_session, kube_namespace
    events = [warning_event(namespace, f"run-{i}-worker-0", message="x" * 30_000) for i in range(4)]
    plane.kubectl("create", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": events}))
    kube = admin_client(plane)
    try:
        found, complete = await kube.list("v1", "Event", namespace, page_bytes=200_000, fieldSelector="type=Warning")
        assert complete and len(found) == 4
        with pytest.raises(AnswerTooLarge, match="longer than 100000 bytes"):
            await kube.list("v1", "Event", namespace, page_bytes=100_000, fieldSelector="type=Warning")
    finally:
        await kube.close()


def admin_client(plane) -> Kube:
    pki = plane.pki
    return Kube(
        kopf.ConnectionInfo(
            server=plane.server,
            ca_path=str(pki / "ca.crt"),
            certificate_path=str(pki / "admin.crt"),
            private_key_path=str(pki / "admin.key"),
        )
    )


@pytest.mark.asyncio
async def test_the_server_filters_by_field_selector_before_it_pages(kube_cluster_session, kube_namespace):
    """The API allows a page with fewer items than its limit, even none, and a continue token (filtering after
    reading a page from etcd); Kube.list bounds its requests for that (test_kube.py). This server (v1.36, lists from
    its watch cache) filters first: Warning Events behind 200 Normal ones come in the first page of 50."""
    plane, namespace = kube_cluster_session, kube_namespace
    normal = [warning_event(namespace, f"a-{i:03d}", "Pulled", "Normal") for i in range(200)]
    warnings = [warning_event(namespace, f"z-{i}") for i in range(3)]
    plane.kubectl(
        "create", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": normal + warnings})
    )
    kube = admin_client(plane)
    try:
        found, complete = await kube.list("v1", "Event", namespace, page_size=50, pages=1, fieldSelector="type=Warning")
        assert complete and sorted(e["involvedObject"]["name"] for e in found) == ["z-0", "z-1", "z-2"]
    finally:
        await kube.close()


@pytest.mark.asyncio
async def test_the_operators_client_reads_both_answer_framings_and_a_watch_from_the_real_server(
    kube_cluster_session, kube_namespace
):
    """Against the real server, not the loopback script: a small answer comes with Content-Length, a large one chunked
    (Go's server chunks what does not fit its buffer), a watch as a chunk per event."""
    plane, namespace = kube_cluster_session, kube_namespace
    kube = admin_client(plane)
    try:
        big = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big", "namespace": namespace}}
        await kube.create({**big, "data": {"k": "v" * 200_000}})
        await kube.create({**big, "metadata": {"name": "small", "namespace": namespace}, "data": {"k": "v"}})
        small = await kube.get("v1", "ConfigMap", namespace, "small")
        large = await kube.get("v1", "ConfigMap", namespace, "big")
        assert small["data"] == {"k": "v"} and large["data"]["k"] == "v" * 200_000
        with pytest.raises(AnswerTooLarge, match="longer than 100000 bytes"):
            await kube.request("GET", f"/api/v1/namespaces/{namespace}/configmaps/big", max_bytes=100_000)
        assert (await kube.get("v1", "ConfigMap", namespace, "small"))["data"] == {"k": "v"}  # the next one is its own
        path = f"/api/v1/namespaces/{namespace}/configmaps?watch=true&resourceVersion=0"
        seen = set()
        async for event in kube.watch(path):
            seen.add(event["object"]["metadata"]["name"])
            if seen >= {"big", "small"}:
                break
    finally:
        await kube.close()
