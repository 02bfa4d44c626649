"""Record which API calls the operator makes over a whole run lifecycle, for the RBAC test (test_chart.py).

    python tests/integration/record_operator_calls.py OUT.yaml

Runs the real operator against kmock, plays Kubeflow and the kubelet (create, fail, recover, suspend,
resume, succeed, delete), then the JobSet controller for a run with spec.backend JobSet (create, suspend, resume,
succeed, delete), and writes the sorted list of (apiGroup, resource[/subresource], verb) of
every request that came from the operator (kopf's or its own client, told apart by User-Agent).
"""

import asyncio
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kmock as kmock_lib  # noqa: E402
from kmock._internal import parsing  # noqa: E402

from operator_harness import (  # noqa: E402
    JOBSETS,
    RUNS,
    Cluster,
    declare_resources,
    eventually,
    operator,
    running,
    terminated,
    training_run,
)

VERBS = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}


def verb_of(request) -> str:
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    if method == "GET":
        if request.params.get("watch") == "true":
            return "watch"
        return "get" if parsing.parse_path(request.url.path).name else "list"
    return VERBS[method]


async def record(out: Path) -> None:
    async with kmock_lib.KubernetesEmulator() as kmock, kmock_lib.Server(kmock):
        declare_resources(kmock, jobsets=True)
        cluster = Cluster(kmock)
        async with operator(kmock):
            # two pods: a rendezvous Service, created at attempt 1 and brought up to date at each later one
            await cluster.create_run(training_run(recovery={"backoffSeconds": 0}, replicas={"min": 2, "max": 2}))
            await eventually(lambda: cluster.job("demo-a1"))
            pod = await cluster.add_pod("demo-a1", status=running())
            await cluster.job_condition("demo-a1", "Created", "Running")
            await cluster.pod_status(pod, terminated(137, "OOMKilled"))
            await cluster.job_condition("demo-a1", "Failed")
            await eventually(lambda: cluster.job("demo-a2"))
            await eventually(lambda: cluster.status().get("attempt") == 2)
            await cluster.patch(RUNS, "demo", {"spec": {"suspend": True}})
            await eventually(lambda: cluster.status().get("phase") == "Suspended")
            await cluster.patch(RUNS, "demo", {"spec": {"suspend": False}})
            await eventually(lambda: cluster.job("demo-a3"))
            await cluster.job_condition("demo-a3", "Created", "Succeeded")
            await eventually(lambda: cluster.status().get("phase") == "Succeeded")
            await eventually(lambda: cluster.job_names() == ["demo-a3"])
            await cluster.delete(RUNS, "demo")
            await eventually(lambda: cluster.obj(RUNS, "demo") is None)
            await jobset_lifecycle(cluster)
        calls = set()
        for request in list(kmock):
            agent = request.headers.get("User-Agent", "")
            if not agent.startswith(("kopf", "trainingrun-operator")):
                continue  # the script's own requests (playing kubectl, Kubeflow and the kubelet)
            path = parsing.parse_path(request.url.path)
            if path.plural is None:
                continue  # discovery (/api, /apis/...): allowed to every authenticated client
            resource = path.plural + (f"/{path.subresource}" if path.subresource else "")
            calls.add((path.group or "", resource, verb_of(request)))
    out.write_text(yaml.safe_dump(sorted(list(c) for c in calls)))


async def jobset_lifecycle(cluster: Cluster) -> None:
    """A run on the JobSet backend, the JobSet controller played through the JobSet's status."""

    async def jobset_condition(name: str, type_: str) -> None:
        condition = {
            "type": type_,
            "status": "True",
            "reason": type_,
            "message": "",
            "lastTransitionTime": "2026-12-06T00:00:00Z",
        }
        await cluster.patch(JOBSETS, name, {"status": {"conditions": [condition]}}, subresource="status")

    await cluster.create_run(training_run("js", "0000-js", backend="JobSet"))
    await eventually(lambda: cluster.obj(JOBSETS, "js-a1"))
    await cluster.patch(RUNS, "js", {"spec": {"suspend": True}})
    await eventually(lambda: (cluster.obj(JOBSETS, "js-a1") or {}).get("spec", {}).get("suspend") is True)
    await cluster.patch(RUNS, "js", {"spec": {"suspend": False}})
    await eventually(lambda: cluster.obj(JOBSETS, "js-a2"))
    await eventually(lambda: cluster.obj(JOBSETS, "js-a1") is None)
    await jobset_condition("js-a2", "Completed")
    await eventually(lambda: cluster.status("js").get("phase") == "Succeeded")
    await cluster.delete(RUNS, "js")
    await eventually(lambda: cluster.obj(RUNS, "js") is None)


if __name__ == "__main__":
    asyncio.run(record(Path(sys.argv[1])))
