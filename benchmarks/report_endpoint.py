"""The operator's report endpoint under a fleet's load: rank 0 of every run reports every 10 s.

Starts a real control plane (tests/kube_cluster.py: etcd, kube-apiserver with RBAC and ServiceAccount
tokens, kube-controller-manager), installs the CRDs and the chart's RBAC, and runs `trainingrun operator`
as its own process with the chart's identity and the report endpoint on HTTPS (a certificate this script
makes). Then --runs TrainingRuns start; each gets a worker pod as Kubeflow creates it (owned by the
attempt's PyTorchJob) and a pod-bound token for the report audience (TokenRequest, as the kubelet's
projected token). Every run reports every --interval seconds for --rounds rounds, spread evenly over the
interval (as unsynchronised trainers do), each report a new TLS connection as the trainer's urllib makes
it. Figures: latency of each report (request sent -> answer read), p50/p95/max, for the first round (every
token new: a TokenReview each) and for the later ones (TokenReview answers cached per token), and how many
reports were accepted. The status writes themselves are the operator's (a patch per changed report).

Target (issue 15): p95 < 50 ms per report with 200 runs reporting every 10 s.

Needs the real-API tier's binaries (as `make test`):
    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/report_endpoint.py [--runs 200] [--rounds 3]
Last line: `result: runs=<n> reports=<n> accepted=<n> p50_ms=<x> p95_ms=<x> first_round_p95_ms=<x>
cached_p95_ms=<x>`.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "real_api")]

import kube_cluster  # noqa: E402
from test_operator_real import wait_for  # noqa: E402
from test_reports_real import certificate  # noqa: E402

from trainingrun_trainer import contract  # noqa: E402
from trainingrun_trainer.contract import Progress, Report  # noqa: E402

NAMESPACE, ACCOUNT = "fleet", "trainers"
PYTORCHJOB_CRD = REPO / "tests" / "fixtures" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def operator_identity(plane: kube_cluster.ControlPlane, workdir: Path) -> Path:
    """The chart's RBAC applied, and a kubeconfig with its ServiceAccount's token (as test_operator_real.py)."""
    helm = REPO / ".tools/bin/helm"
    rendered = subprocess.run([str(helm), "template", "bench", str(REPO / "charts/trainingrun-operator"),
                               "--namespace", "trainingrun-bench"], capture_output=True, text=True, check=True).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] not in ("Deployment", "Secret")]
    plane.kubectl("create", "namespace", "trainingrun-bench")
    plane.apply(documents)
    account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]["name"]
    return plane.token_kubeconfig(workdir / "operator.kubeconfig", plane.token("trainingrun-bench", account))


def start_fleet(plane: kube_cluster.ControlPlane, runs: int) -> list[tuple[str, str, str]]:
    """`runs` TrainingRuns Running, each with a worker pod: [(name, run uid, pod-bound token)]."""
    plane.kubectl("-n", NAMESPACE, "create", "serviceaccount", ACCOUNT)
    names = [f"run-{i:04d}" for i in range(runs)]
    plane.apply([{"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun",
                  "metadata": {"name": name, "namespace": NAMESPACE},
                  "spec": {"checkpoint": {"uri": f"s3://bucket/{name}"}, "serviceAccountName": ACCOUNT}}
                 for name in names])
    jobs_path = f"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"
    wait_for(lambda: len(plane.request("GET", jobs_path)[1].get("items") or []) >= runs, 300, f"{runs} PyTorchJobs")
    jobs = {j["metadata"]["name"]: j for j in plane.request("GET", jobs_path)[1]["items"]}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fleet = []
    for name in names:
        job = jobs[f"{name}-a1"]
        plane.request("PATCH", f"{jobs_path}/{name}-a1/status", {"status": {"conditions": [
            {"type": t, "status": "True", "reason": t, "message": "", "lastUpdateTime": now, "lastTransitionTime": now}
            for t in ("Created", "Running")]}}, content_type="application/merge-patch+json")
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"{name}-a1-worker-0", "namespace": NAMESPACE, "labels": template["metadata"]["labels"],
            "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": f"{name}-a1",
                                 "uid": job["metadata"]["uid"], "controller": True}]}, "spec": template["spec"]}
        code, created = plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
        assert code == 201, created
        code, token = plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [contract.REPORT_AUDIENCE], "expirationSeconds": 7200,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                        "uid": created["metadata"]["uid"]}}})
        assert code == 201, token
        uid = job["metadata"]["ownerReferences"][0]["uid"]
        fleet.append((name, uid, token["status"]["token"]))
    runs_path = f"/apis/trainingrun.dev/v1alpha1/namespaces/{NAMESPACE}/trainingruns"
    wait_for(lambda: sum(1 for r in plane.request("GET", runs_path)[1]["items"]
                         if (r.get("status") or {}).get("phase") == "Running") >= runs, 300, "every run Running")
    return fleet


def report_once(url: str, context: ssl.SSLContext, name: str, uid: str, token: str, step: int) -> tuple[float, int]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = Report(NAMESPACE, name, uid, 1, progress=Progress(step, now, loss=1.0)).to_json()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            response.read()
            code = response.status
    except urllib.error.HTTPError as error:
        code = error.code
    return time.perf_counter() - began, code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="report rounds (the first one is uncached)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between a run's reports (default 10)")
    args = parser.parse_args(argv)
    assets = os.environ.get(kube_cluster.ASSETS_ENV)
    if kube_cluster.missing_binaries(assets):
        raise SystemExit(f"needs {kube_cluster.ASSETS_ENV}: {kube_cluster.HOW_TO_GET}")
    with tempfile.TemporaryDirectory(prefix="report-endpoint-") as tmp:
        workdir = Path(tmp)
        plane = kube_cluster.ControlPlane(Path(assets), workdir / "plane").start()
        operator = None
        try:
            plane.kubectl("apply", "--server-side", "-f", str(REPO / "manifests/crds"), "-f", str(PYTORCHJOB_CRD))
            for crd in ("trainingruns.trainingrun.dev", "pytorchjobs.kubeflow.org"):
                plane.wait_established(crd)
            plane.create_namespace(NAMESPACE)
            kubeconfig = operator_identity(plane, workdir)
            tls = certificate(workdir)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            url = f"https://127.0.0.1:{port}{contract.REPORT_PATH}"
            env = {**os.environ, "KUBECONFIG": str(kubeconfig), "TRAININGRUN_REPORT_URL": url,
                   "TRAININGRUN_REPORT_PORT": str(port), "TRAININGRUN_REPORT_TLS_DIR": str(tls),
                   "TRAININGRUN_OPERATOR_METRICS_PORT": "0", "TRAININGRUN_OPERATOR_HEALTH_PORT": "0"}
            log = workdir / "operator.log"
            operator = subprocess.Popen([sys.executable, "-m", "trainingrun_operator"], env=env,
                                        stdout=open(log, "w"), stderr=subprocess.STDOUT)
            wait_for(lambda: "report endpoint listening" in log.read_text() or operator.poll() is not None, 60,
                     "the report endpoint")
            began = time.monotonic()
            fleet = start_fleet(plane, args.runs)
            print(f"{args.runs} runs Running with a pod and a token each in {time.monotonic() - began:.1f} s")
            context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            rounds: list[list[tuple[float, int]]] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
                for round_ in range(args.rounds):
                    start = time.monotonic()
                    futures = []
                    for i, (name, uid, token) in enumerate(fleet):
                        delay = start + i * args.interval / len(fleet) - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)  # the load's own schedule: one run's report every interval/runs
                        futures.append(pool.submit(report_once, url, context, name, uid, token, 10 * (round_ + 1)))
                    rounds.append([f.result() for f in futures])
                    latencies = [1000 * s for s, _ in rounds[-1]]
                    print(f"round {round_ + 1}: {len(latencies)} reports in {time.monotonic() - start:.1f} s, "
                          f"p50 {statistics.median(latencies):.1f} ms, p95 {percentile(latencies, 0.95):.1f} ms, "
                          f"max {max(latencies):.1f} ms, accepted {sum(1 for _, c in rounds[-1] if c == 200)}")
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(timeout=30)
            plane.stop()
    everything = [1000 * s for r in rounds for s, _ in r]
    first = [1000 * s for s, _ in rounds[0]]
    cached = [1000 * s for r in rounds[1:] for s, _ in r] or first
    accepted = sum(1 for r in rounds for _, c in r if c == 200)
    print(f"{'':<14}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}")
    for label, values in (("all", everything), ("first round", first), ("cached", cached)):
        print(f"{label:<14}{statistics.median(values):8.1f}{percentile(values, 0.95):8.1f}{max(values):8.1f}")
    p95 = percentile(everything, 0.95)
    print(f"target p95 < 50 ms: {'met' if p95 < 50 else 'NOT met'} ({p95:.1f} ms); first round / cached p95 "
          f"{percentile(first, 0.95) / percentile(cached, 0.95):.2f} x")
    print(f"result: runs={args.runs} reports={len(everything)} accepted={accepted} "
          f"p50_ms={statistics.median(everything):.1f} p95_ms={p95:.1f} "
          f"first_round_p95_ms={percentile(first, 0.95):.1f} cached_p95_ms={percentile(cached, 0.95):.1f}")
    return 0 if accepted == len(everything) else 1


if __name__ == "__main__":
    sys.exit(main())
