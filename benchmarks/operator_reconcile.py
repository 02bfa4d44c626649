"""How fast the operator turns a burst of TrainingRuns into PyTorchJobs, and what it costs in memory.

Starts kmock (the stateful Kubernetes API emulator) in this process and the real operator
(`python -m trainingrun_operator`) as a separate process logged in through a kubeconfig, waits
until it watches, creates N TrainingRuns at once (concurrent POSTs), and records for each the time
from its create call returning to its attempt-1 PyTorchJob appearing in the API. Prints p50/p95
latency, the time until the last job appeared, and the operator's resident memory (now and peak).
Targets (issue 5): p50 <= 100 ms, all 200 within 20 s, RSS <= 150 MB.

    python benchmarks/operator_reconcile.py [--runs 200]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

RUNS = "trainingrun.dev/v1alpha1/trainingruns"
NAMESPACE = "bench"


def declare(kmock, kmock_lib) -> None:
    verbs = {"list", "watch", "get", "patch", "create", "delete", "update"}
    info = kmock_lib.ResourceInfo
    kmock.resources[RUNS] = info(kind="TrainingRun", namespaced=True, verbs=verbs, subresources={"status"})
    kmock.resources["kubeflow.org/v1/pytorchjobs"] = info(kind="PyTorchJob", namespaced=True, verbs=verbs)
    kmock.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=verbs)
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list", "watch", "get"})
    for plural, kind in (("events", "Event"), ("configmaps", "ConfigMap"), ("serviceaccounts", "ServiceAccount")):
        kmock.resources[f"v1/{plural}"] = info(kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in (("roles", "Role"), ("rolebindings", "RoleBinding")):
        kmock.resources[f"rbac.authorization.k8s.io/v1/{plural}"] = info(kind=kind, namespaced=True, verbs=verbs)


def memory_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def main_async(count: int) -> int:
    import aiohttp
    import kmock as kmock_lib

    async with kmock_lib.KubernetesEmulator() as kmock, kmock_lib.Server(kmock):
        declare(kmock, kmock_lib)
        url = str(kmock.url).rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                "users": [{"name": "bench", "user": {"token": "bench"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "bench"}}],
            }))
            env = {**os.environ, "KUBECONFIG": str(kubeconfig), "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
                   "TRAININGRUN_OPERATOR_HEALTH_PORT": "0"}
            log = open(Path(tmp) / "operator.log", "w")
            operator = subprocess.Popen([sys.executable, "-m", "trainingrun_operator", "--standalone"],
                                        env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 60
                while not any("watch=true" in str(r.url) and "trainingruns" in str(r.url) for r in list(kmock)):
                    if operator.poll() is not None or time.monotonic() > deadline:
                        print(Path(log.name).read_text()[-3000:], file=sys.stderr)
                        raise SystemExit("the operator did not start watching")
                    await asyncio.sleep(0.05)
                idle = memory_kb(operator.pid)

                created: dict[str, float] = {}
                appeared: dict[str, float] = {}
                job = kmock_lib.resource("kubeflow.org/v1/pytorchjobs")

                async def create(session: aiohttp.ClientSession, index: int) -> None:
                    name = f"run-{index:04d}"
                    body = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun",
                            "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{index}",
                                         "resourceVersion": "1"},
                            "spec": {"checkpoint": {"uri": f"s3://bench/{name}"}}}
                    async with session.post(f"{url}/apis/trainingrun.dev/v1alpha1/namespaces/{NAMESPACE}/trainingruns",
                                            json=body) as response:
                        assert response.status < 300, await response.text()
                    created[name] = time.monotonic()

                async def watch_jobs() -> None:
                    while len(appeared) < count:
                        now = time.monotonic()
                        for (resource, _, name), obj in list(kmock.objects.items()):
                            if resource == job and name.endswith("-a1") and name[:-3] not in appeared:
                                appeared[name[:-3]] = now
                        await asyncio.sleep(0.002)

                watcher = asyncio.create_task(watch_jobs())
                started = time.monotonic()
                async with aiohttp.ClientSession() as session:
                    await asyncio.gather(*(create(session, i) for i in range(count)))
                await asyncio.wait_for(watcher, 120)
                total = max(appeared.values()) - started
                latencies = sorted(max(0.0, appeared[n] - created[n]) * 1000 for n in created)
                busy = memory_kb(operator.pid)
            finally:
                operator.terminate()
                operator.wait(30)
                log.close()

    p50 = statistics.median(latencies)
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    rss_mb, peak_mb = busy["VmRSS"] / 1024, busy["VmHWM"] / 1024
    print(f"{count} TrainingRuns created at once against kmock; operator in its own process")
    print(f"{'':24} {'figure':>10} {'target':>10} {'ratio':>7}")
    for label, value, target in (("p50 create->job (ms)", p50, 100), ("p95 create->job (ms)", p95, None),
                                 ("all jobs present (s)", total, 20), ("operator RSS (MB)", rss_mb, 150),
                                 ("operator peak RSS (MB)", peak_mb, 150)):
        ratio = f"{value / target:.2f}" if target else "-"
        print(f"{label:24} {value:>10.1f} {target if target else '-':>10} {ratio:>7}")
    print(f"operator RSS before the burst: {idle['VmRSS'] / 1024:.1f} MB")
    print(f"result: p50_ms={p50:.1f} p95_ms={p95:.1f} total_s={total:.2f} rss_mb={rss_mb:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    return asyncio.run(main_async(parser.parse_args().runs))


if __name__ == "__main__":
    sys.exit(main())
