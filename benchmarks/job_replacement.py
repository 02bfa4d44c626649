"""How soon Kubernetes' Job controller replaces a failed pod of an Indexed Job (what a JobSet attempt's lost pod
waits for; Kubeflow's operator replaces a PyTorchJob's at once), and whether podFailurePolicy's `Ignore` changes it.

Starts a real control plane (tests/kube_cluster.py: etcd, kube-apiserver, kube-controller-manager from
$KUBEBUILDER_ASSETS; no kubelet), creates a 2-pod Indexed Job as jobset.py renders one (FailJob on exit codes 1-127)
and one that also ignores 128-255, and fails its newest pod `--failures` times in a row through the pod's status (as a
kubelet would report exit code 134), timing each failure -> the replacement pod's creation by polling the API every
0.1 s. Prints the seconds per failure for both, side by side.

    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/job_replacement.py [--failures 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import kube_cluster  # noqa: E402


def indexed_job(name: str, ignore_retryable: bool) -> dict[str, Any]:
    rules: list[dict[str, Any]] = [
        {"action": "FailJob", "onExitCodes": {"containerName": "c", "operator": "In", "values": list(range(1, 128))}}
    ]
    if ignore_retryable:
        rules.append(
            {
                "action": "Ignore",
                "onExitCodes": {"containerName": "c", "operator": "In", "values": list(range(128, 256))},
            }
        )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "completionMode": "Indexed",
            "backoffLimit": 10,
            "podFailurePolicy": {"rules": rules},
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "unused"}]}},
        },
    }


def pods(plane: kube_cluster.ControlPlane, job: str) -> list[dict[str, Any]]:
    answer = plane.kubectl("get", "pods", "-l", f"batch.kubernetes.io/job-name={job}", "-o", "json").stdout
    return sorted(json.loads(answer)["items"], key=lambda p: p["metadata"]["creationTimestamp"])


def fail(plane: kube_cluster.ControlPlane, pod: str, exit_code: int) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    terminated = {"exitCode": exit_code, "reason": "Error", "startedAt": now, "finishedAt": now}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "c",
                "image": "unused",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": terminated},
            }
        ],
    }
    plane.kubectl("patch", "pod", pod, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}))


def replacement_seconds(
    plane: kube_cluster.ControlPlane, job: str, failures: int, limit: float
) -> list[Optional[float]]:
    deadline = time.monotonic() + 60
    while len(pods(plane, job)) < 2:
        assert time.monotonic() < deadline, "the Job controller made no pods"
        time.sleep(0.1)  # polling the API
    seconds: list[Optional[float]] = []
    for _ in range(failures):
        present = pods(plane, job)
        seen = {p["metadata"]["name"] for p in present}
        started = time.monotonic()
        fail(plane, present[-1]["metadata"]["name"], 134)
        while not any(p["metadata"]["name"] not in seen for p in pods(plane, job)):
            if time.monotonic() - started > limit:
                seconds.append(None)
                return seconds
            time.sleep(0.1)  # polling the API
        seconds.append(time.monotonic() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=3, help="pods failed in a row per Job")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds to wait for one replacement at most")
    args = parser.parse_args()
    assets = os.environ.get(kube_cluster.ASSETS_ENV)
    missing = kube_cluster.missing_binaries(assets)
    if missing:
        sys.exit(f"job_replacement: missing {', '.join(missing)}; {kube_cluster.HOW_TO_GET}")
    with tempfile.TemporaryDirectory(prefix="job-replacement-") as workdir:
        plane = kube_cluster.ControlPlane(Path(str(assets)), Path(workdir))
        plane.start()
        try:
            results = {}
            for name, ignore in (("counted", False), ("ignored", True)):
                plane.kubectl("create", "-f", "-", input=json.dumps(indexed_job(name, ignore)))
                results[name] = replacement_seconds(plane, name, args.failures, args.limit)
        finally:
            plane.stop()
    print("failure -> replacement pod created, seconds, per failure in a row (pod exit code 134)")
    for name, label in (("counted", "counted toward backoffLimit (jobset.py)"), ("ignored", "podFailurePolicy Ignore")):
        shown = " ".join("-" if s is None else f"{s:.1f}" for s in results[name])
        print(f"  {label:42s} {shown}")
    first = [results[n][0] for n in ("counted", "ignored") if results[n] and results[n][0] is not None]
    print(f"result: first_replacement_s={min(first):.1f}" if first else "result: no replacement")


if __name__ == "__main__":
    main()
