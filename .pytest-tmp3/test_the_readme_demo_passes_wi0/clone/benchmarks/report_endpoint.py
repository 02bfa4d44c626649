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

--flood RATE (issue 35): after the rounds, a separate process sends RATE junk-token requests a second for
--flood-seconds (bounded in count and time) over kept-alive connections from --flood-sources loopback addresses
(127.0.0.2 and up), half of them junk strings and half forged tokens shaped like a pod's report token (the right
audience and a pod binding, a bad signature: each would need a TokenReview). Meanwhile the fleet reports one more
round, and --reconciles new TrainingRuns are created one after another, timed from the create to their PyTorchJob
appearing; the same number is timed before the flood. Targets: reports p95 < 100 ms, reconcile delayed <= 50 ms.

--soak-minutes M (issue 40): after the rounds, the fleet goes on reporting every --interval for M minutes (stops by
itself; at most 100, the tokens' lifetime bounds it), each report a new step as a training run's. Every minute it
prints the reports answered, their p95, and the operator's RSS and CPU; the figures are RSS at minute 5 against the
last minute (the one-hour soak: --runs 2000 --soak-minutes 60).

Needs the real-API tier's binaries (as `make test`):
    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/report_endpoint.py [--runs 200] [--rounds 3]
Last line: `result: runs=<n> reports=<n> accepted=<n> p50_ms=<x> p95_ms=<x> first_round_p95_ms=<x>
cached_p95_ms=<x>` (with --flood also `flood_sent_per_s=<x> flood_report_p95_ms=<x> reconcile_p50_ms=<x>
flood_reconcile_p50_ms=<x> reconcile_delay_ms=<x> token_reviews=<n>`; with --soak-minutes also `soak_minutes=<x>
soak_reports=<n> soak_accepted=<n> soak_reports_per_s=<x> soak_worst_minute_p95_ms=<x> soak_rss_mb_min5=<x> soak_rss_mb_end=<x>
soak_rss_growth_mb=<x> soak_cpu_ms_per_report=<x> soak_status_writes_per_s=<x>`).

    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/report_endpoint.py --runs 50 --rounds 2 --flood 2000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "real_api")]

from test_operator_real import wait_for  # noqa: E402
from test_reports_real import certificate  # noqa: E402

import kube_cluster  # noqa: E402
from trainingrun_api import contract  # noqa: E402
from trainingrun_api.progress_report import Progress, Report  # noqa: E402

NAMESPACE, ACCOUNT = "fleet", "trainers"
#: The fleet's report tokens live this long; a soak ends well before (setup and rounds come first).
TOKEN_SECONDS, SOAK_MAX_MINUTES = 7200, 100
PYTORCHJOB_CRD = REPO / "tests" / "fixtures" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def operator_identity(plane: kube_cluster.ControlPlane, workdir: Path) -> Path:
    """The chart's RBAC applied, and a kubeconfig with its ServiceAccount's token (as test_operator_real.py)."""
    helm = REPO / ".tools/bin/helm"
    rendered = subprocess.run(
        [str(helm), "template", "bench", str(REPO / "charts/trainingrun-operator"), "--namespace", "trainingrun-bench"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] not in ("Deployment", "Secret")]
    plane.kubectl("create", "namespace", "trainingrun-bench")
    plane.apply(documents)
    account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]["name"]
    return plane.token_kubeconfig(workdir / "operator.kubeconfig", plane.token("trainingrun-bench", account))


def start_fleet(plane: kube_cluster.ControlPlane, runs: int) -> list[tuple[str, str, str]]:
    """`runs` TrainingRuns Running, each with a worker pod: [(name, run uid, pod-bound token)]."""
    plane.kubectl("-n", NAMESPACE, "create", "serviceaccount", ACCOUNT)
    names = [f"run-{i:04d}" for i in range(runs)]
    plane.apply(
        [
            {
                "apiVersion": "trainingrun.dev/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"checkpoint": {"uri": f"s3://bucket/{name}"}, "serviceAccountName": ACCOUNT},
            }
            for name in names
        ]
    )
    jobs_path = f"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"
    wait_for(lambda: len(plane.request("GET", jobs_path)[1].get("items") or []) >= runs, 300, f"{runs} PyTorchJobs")
    jobs = {j["metadata"]["name"]: j for j in plane.request("GET", jobs_path)[1]["items"]}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fleet = []
    for name in names:
        job = jobs[f"{name}-a1"]
        plane.request(
            "PATCH",
            f"{jobs_path}/{name}-a1/status",
            {
                "status": {
                    "conditions": [
                        {
                            "type": t,
                            "status": "True",
                            "reason": t,
                            "message": "",
                            "lastUpdateTime": now,
                            "lastTransitionTime": now,
                        }
                        for t in ("Created", "Running")
                    ]
                }
            },
            content_type="application/merge-patch+json",
        )
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-a1-worker-0",
                "namespace": NAMESPACE,
                "labels": template["metadata"]["labels"],
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": f"{name}-a1",
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
        code, created = plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
        assert code == 201, created
        code, token = plane.request(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [contract.REPORT_AUDIENCE],
                    "expirationSeconds": TOKEN_SECONDS,
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": pod["metadata"]["name"],
                        "uid": created["metadata"]["uid"],
                    },
                },
            },
        )
        assert code == 201, token
        uid = job["metadata"]["ownerReferences"][0]["uid"]
        fleet.append((name, uid, token["status"]["token"]))
    runs_path = f"/apis/trainingrun.dev/v1alpha1/namespaces/{NAMESPACE}/trainingruns"
    wait_for(
        lambda: (
            sum(
                1
                for r in plane.request("GET", runs_path)[1]["items"]
                if (r.get("status") or {}).get("phase") == "Running"
            )
            >= runs
        ),
        300,
        "every run Running",
    )
    return fleet


def pod_address(number: int) -> str:
    """The loopback address run `number`'s pod reports from: pods have addresses of their own, and the endpoint
    limits new tokens per source address (from one address, 2,000 pods would be throttled as a flood)."""
    return f"127.1.{number // 250}.{number % 250 + 1}"


def report_once(
    url: str, context: ssl.SSLContext, name: str, uid: str, token: str, step: int, source: str = "127.0.0.1"
) -> tuple[float, int]:
    """One report as the trainer sends it (a new TLS connection), from `source`: (seconds, status code; 0 when
    the connection failed or timed out)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    progress = Progress(step=step, updated_at=now, loss=1.0)
    body = Report(namespace=NAMESPACE, name=name, uid=uid, attempt=1, progress=progress).to_json()
    where = urllib.parse.urlsplit(url)
    began = time.perf_counter()
    connection = http.client.HTTPSConnection(
        where.hostname, where.port, timeout=30, context=context, source_address=(source, 0)
    )
    try:
        connection.request(
            "POST", where.path, body, {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        )
        response = connection.getresponse()
        response.read()
        code = response.status
    except OSError:  # refused, reset or timed out: counted as not accepted, the load goes on
        code = 0
    finally:
        connection.close()
    return time.perf_counter() - began, code


def forged_token(number: int) -> str:
    """Shaped like a pod's projected report token (audience, expiry, pod binding) with a signature that is not."""
    import base64
    import json

    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    claims = {
        "aud": [contract.REPORT_AUDIENCE],
        "exp": int(time.time()) + 3600,
        "iss": "https://kubernetes",
        "sub": "system:serviceaccount:fleet:trainers",
        "jti": str(number),
        "kubernetes.io": {
            "namespace": NAMESPACE,
            "pod": {"name": f"p{number}", "uid": str(number)},
            "serviceaccount": {"name": ACCOUNT, "uid": "x"},
        },
    }
    return f"{part({'alg': 'RS256', 'kid': 'k'})}.{part(claims)}.{part({'forged': number})}"


async def _flood(url: str, ca: str, rate: float, seconds: float, sources: int, out: str) -> None:
    """Send `rate` junk-token reports a second for `seconds` (at most rate * seconds, then stop), over kept-alive
    connections from 127.0.0.2.. 127.0.0.(1 + sources); write {sent, answered: {status: n}, not_sent} to `out`."""
    import asyncio
    import json

    import aiohttp

    context = ssl.create_default_context(cafile=ca)
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=32, local_addr=(f"127.0.0.{2 + i}", 0)))
        for i in range(sources)
    ]
    answered: dict[str, int] = {}
    progress = Progress(step=1, updated_at="2026-01-01T00:00:00Z")
    body = Report(namespace=NAMESPACE, name="run-0000", uid="uid", attempt=1, progress=progress).to_json()
    in_flight = asyncio.Semaphore(256)
    sent = not_sent = 0

    async def one(number: int) -> None:
        token = f"junk-{number}" if number % 2 else forged_token(number)
        try:
            async with sessions[number % sources].post(
                url, data=body, headers={"Authorization": f"Bearer {token}"}, timeout=aiohttp.ClientTimeout(total=10)
            ) as response:
                await response.read()
                key = str(response.status)
        except Exception as error:  # noqa: BLE001 - counted, the flood goes on
            key = type(error).__name__
        finally:
            in_flight.release()
        answered[key] = answered.get(key, 0) + 1

    tasks = []
    began = time.monotonic()
    total = int(rate * seconds)
    for number in range(total):
        due = began + number / rate
        if due > time.monotonic():
            await asyncio.sleep(due - time.monotonic())
        if time.monotonic() - began > seconds + 5:
            break  # bounded in time as well as in count
        if in_flight.locked():
            not_sent += 1  # this client cannot keep up: counted, never queued without bound
            continue
        await in_flight.acquire()
        sent += 1
        tasks.append(asyncio.ensure_future(one(number)))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - began
    for session in sessions:
        await session.close()
    Path(out).write_text(json.dumps({"sent": sent, "not_sent": not_sent, "seconds": elapsed, "answered": answered}))


def reconcile_latencies(plane: kube_cluster.ControlPlane, prefix: str, count: int) -> list[float]:
    """Create `count` TrainingRuns one after another; each: seconds from the create to its PyTorchJob appearing."""
    jobs_path = f"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"
    runs_path = f"/apis/trainingrun.dev/v1alpha1/namespaces/{NAMESPACE}/trainingruns"
    latencies = []
    for number in range(count):
        name = f"{prefix}-{number:03d}"
        began = time.perf_counter()
        code, created = plane.request(
            "POST",
            runs_path,
            {
                "apiVersion": "trainingrun.dev/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"checkpoint": {"uri": f"s3://bucket/{name}"}, "serviceAccountName": ACCOUNT},
            },
        )
        assert code == 201, created
        deadline = time.monotonic() + 60
        while plane.request("GET", f"{jobs_path}/{name}-a1")[0] != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no PyTorchJob for {name} within 60 s")
            time.sleep(0.005)
        latencies.append(time.perf_counter() - began)
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="report rounds (the first one is uncached)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between a run's reports (default 10)")
    parser.add_argument("--flood", type=float, default=0, help="junk-token requests a second after the rounds")
    parser.add_argument("--flood-seconds", type=float, default=20.0)
    parser.add_argument("--flood-sources", type=int, default=8, help="loopback source addresses of the flood")
    parser.add_argument("--reconciles", type=int, default=10, help="runs created and timed with and without flood")
    parser.add_argument("--flood-worker", nargs=2, metavar=("URL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    parser.add_argument("--soak-minutes", type=float, default=0, help="then report for this long (at most 100)")
    args = parser.parse_args(argv)
    if not 0 <= args.soak_minutes <= SOAK_MAX_MINUTES:
        parser.error(f"--soak-minutes must be 0 to {SOAK_MAX_MINUTES} (the fleet's tokens live {TOKEN_SECONDS} s)")
    if args.flood_worker:
        import asyncio

        asyncio.run(
            _flood(
                args.flood_worker[0], args.ca, args.flood, args.flood_seconds, args.flood_sources, args.flood_worker[1]
            )
        )
        return 0
    flooded: dict = {}
    soaked: dict = {}
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
            env = {
                **os.environ,
                "KUBECONFIG": str(kubeconfig),
                "TRAININGRUN_REPORT_URL": url,
                "TRAININGRUN_REPORT_PORT": str(port),
                "TRAININGRUN_REPORT_TLS_DIR": str(tls),
                "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
                "TRAININGRUN_OPERATOR_HEALTH_PORT": "0",
            }
            log = workdir / "operator.log"
            operator = subprocess.Popen(
                [sys.executable, "-m", "trainingrun_operator"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
            )
            wait_for(
                lambda: "report endpoint listening" in log.read_text() or operator.poll() is not None,
                60,
                "the report endpoint",
            )
            began = time.monotonic()
            fleet = start_fleet(plane, args.runs)
            print(f"{args.runs} runs Running with a pod and a token each in {time.monotonic() - began:.1f} s")
            context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            rounds: list[list[tuple[float, int]]] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
                for round_ in range(args.rounds):
                    start = time.monotonic()
                    rounds.append(report_round(pool, url, context, fleet, args.interval, 10 * (round_ + 1)))
                    latencies = [1000 * s for s, _ in rounds[-1]]
                    print(
                        f"round {round_ + 1}: {len(latencies)} reports in {time.monotonic() - start:.1f} s, "
                        f"p50 {statistics.median(latencies):.1f} ms, p95 {percentile(latencies, 0.95):.1f} ms, "
                        f"max {max(latencies):.1f} ms, accepted {sum(1 for _, c in rounds[-1] if c == 200)}"
                    )
                if args.flood:
                    flooded = flood_phase(args, plane, url, tls, context, fleet, pool, workdir, operator.pid)
                if args.soak_minutes:
                    writes_before = status_writes(plane)
                    soaked = soak(args, url, context, fleet, pool, operator.pid, first_step=10 * (args.rounds + 1))
                    soaked["status_writes"] = status_writes(plane) - writes_before
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
    print(
        f"target p95 < 50 ms: {'met' if p95 < 50 else 'NOT met'} ({p95:.1f} ms); first round / cached p95 "
        f"{percentile(first, 0.95) / percentile(cached, 0.95):.2f} x"
    )
    flood_line = ""
    if flooded:
        calm, loud, during = flooded["calm"], flooded["loud"], flooded["reports"]
        delay = statistics.median(loud) - statistics.median(calm)
        report_p95 = percentile(during, 0.95)
        print(f"{'flood':<14}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}")
        for label, values in (("reconcile", calm), ("reconcile+fl", loud), ("reports+fl", during)):
            print(f"{label:<14}{statistics.median(values):8.1f}{percentile(values, 0.95):8.1f}{max(values):8.1f}")
        print(
            f"flood: {flooded['sent_per_s']:.0f} requests/s sent for {flooded['seconds']:.1f} s "
            f"({flooded['not_sent']} not sent: the flood client's limit), answered {flooded['answered']}; "
            f"TokenReviews during the flood: {flooded['reviews']}; the operator's CPU per flood request "
            f"{flooded['operator_cpu_us_per_request']:.0f} us (reports and reconciles beside it included)"
        )
        print(
            f"target reports p95 < 100 ms under the flood: {'met' if report_p95 < 100 else 'NOT met'} "
            f"({report_p95:.1f} ms); reconcile delayed <= 50 ms: {'met' if delay <= 50 else 'NOT met'} "
            f"({delay:+.1f} ms at p50; flood/calm {statistics.median(loud) / statistics.median(calm):.2f} x)"
        )
        flood_line = (
            f" flood_sent_per_s={flooded['sent_per_s']:.0f} flood_report_p95_ms={report_p95:.1f} "
            f"reconcile_p50_ms={statistics.median(calm):.1f} "
            f"flood_reconcile_p50_ms={statistics.median(loud):.1f} reconcile_delay_ms={delay:.1f} "
            f"token_reviews={flooded['reviews']} "
            f"operator_cpu_us_per_flood_request={flooded['operator_cpu_us_per_request']:.0f}"
        )
    soak_line = soak_summary(soaked) if soaked else ""
    print(
        f"result: runs={args.runs} reports={len(everything)} accepted={accepted} "
        f"p50_ms={statistics.median(everything):.1f} p95_ms={p95:.1f} "
        f"first_round_p95_ms={percentile(first, 0.95):.1f} cached_p95_ms={percentile(cached, 0.95):.1f}"
        + flood_line
        + soak_line
    )
    return 0 if accepted == len(everything) and (not soaked or soaked["accepted"] == soaked["reports"]) else 1


def report_round(pool, url, context, fleet, interval: float, step: int) -> list[tuple[float, int]]:
    """Every run reports once, spread evenly over `interval` seconds; [(seconds, status code)] when all answered."""
    start = time.monotonic()
    futures = []
    for i, (name, uid, token) in enumerate(fleet):
        delay = start + i * interval / len(fleet) - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the load's own schedule: one run's report every interval/runs
        futures.append(pool.submit(report_once, url, context, name, uid, token, step, pod_address(i)))
    return [f.result() for f in futures]


def rss_mb(pid: int) -> float:
    """Resident set size of a process now, in MB (/proc)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def soak(args, url, context, fleet, pool, operator_pid, first_step: int) -> dict:
    """Rounds of reports for --soak-minutes (a round that has begun is finished), a new step each round; at every
    minute's end the reports answered in it, their p95, and the operator's RSS and CPU."""
    began = time.monotonic()
    end = began + 60 * args.soak_minutes
    cpu_began = cpu_seconds(operator_pid)
    minutes: list[dict] = []
    latencies: list[float] = []
    codes: list[int] = []
    step = first_step
    print(f"{'minute':>6}{'reports':>9}{'accepted':>9}{'p95 ms':>8}{'RSS MB':>8}{'CPU s':>7}")
    while time.monotonic() < end:
        results = report_round(pool, url, context, fleet, args.interval, step)
        step += 10
        latencies += [1000 * s for s, _ in results]
        codes += [c for _, c in results]
        while time.monotonic() >= began + 60 * (len(minutes) + 1) or (time.monotonic() >= end and latencies):
            row = {
                "minute": len(minutes) + 1,
                "reports": len(latencies),
                "accepted": sum(1 for c in codes if c == 200),
                "p95_ms": percentile(latencies, 0.95) if latencies else 0.0,
                "rss_mb": rss_mb(operator_pid),
                "cpu_s": cpu_seconds(operator_pid) - cpu_began,
            }
            minutes.append(row)
            latencies, codes = [], []
            print(
                f"{row['minute']:>6}{row['reports']:>9}{row['accepted']:>9}{row['p95_ms']:>8.1f}"
                f"{row['rss_mb']:>8.1f}{row['cpu_s']:>7.1f}",
                flush=True,
            )
    seconds = time.monotonic() - began
    reports = sum(m["reports"] for m in minutes)
    return {
        "minutes": minutes,
        "seconds": seconds,
        "reports": reports,
        "accepted": sum(m["accepted"] for m in minutes),
        "p95_ms": max(m["p95_ms"] for m in minutes),
        "cpu_s": minutes[-1]["cpu_s"],
    }


def soak_summary(soaked: dict) -> str:
    """The soak's figures printed, and its part of the result line. RSS at minute 5 (or the first minute of a shorter
    soak: start-up and the first token reviews are behind it) against the last minute's."""
    minutes = soaked["minutes"]
    early = minutes[max(0, min(4, len(minutes) - 2))]
    last = minutes[-1]
    growth = last["rss_mb"] - early["rss_mb"]
    per_report = 1000 * soaked["cpu_s"] / max(1, soaked["reports"])
    print(
        f"soak: {soaked['reports']} reports in {soaked['seconds'] / 60:.1f} min ({soaked['reports'] / soaked['seconds']:.0f}"
        f"/s), {soaked['accepted']} accepted, worst minute's p95 {soaked['p95_ms']:.1f} ms; operator RSS "
        f"{early['rss_mb']:.1f} MB at minute {early['minute']}, {last['rss_mb']:.1f} MB at minute {last['minute']} "
        f"({growth:+.1f} MB); its CPU {per_report:.2f} ms per report (status writes and their watch events included); "
        f"{soaked['status_writes'] / soaked['seconds']:.1f} status writes a second"
    )
    return (
        f" soak_minutes={soaked['seconds'] / 60:.1f} soak_reports={soaked['reports']} soak_accepted={soaked['accepted']}"
        f" soak_reports_per_s={soaked['reports'] / soaked['seconds']:.1f} soak_worst_minute_p95_ms={soaked['p95_ms']:.1f}"
        f" soak_rss_mb_min{early['minute']}={early['rss_mb']:.1f} soak_rss_mb_end={last['rss_mb']:.1f}"
        f" soak_rss_growth_mb={growth:.1f} soak_cpu_ms_per_report={per_report:.2f}"
        f" soak_status_writes_per_s={soaked['status_writes'] / soaked['seconds']:.1f}"
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood_phase(args, plane, url, tls, context, fleet, pool, workdir, operator_pid) -> dict:
    """Reconciles timed without a flood, then with one: a flood process, a report round and reconciles beside it."""
    import json

    calm = [1000 * s for s in reconcile_latencies(plane, "calm", args.reconciles)]
    reviews_before, cpu_before = token_reviews(plane), cpu_seconds(operator_pid)
    out = workdir / "flood.json"
    flood = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--flood",
            str(args.flood),
            "--flood-seconds",
            str(args.flood_seconds),
            "--flood-sources",
            str(args.flood_sources),
            "--ca",
            str(tls / "ca.crt"),
            "--flood-worker",
            url,
            str(out),
        ]
    )
    try:
        time.sleep(min(3.0, args.flood_seconds / 4))  # the flood at full rate before anything is timed
        start = time.monotonic()
        futures = []
        for i, (name, uid, token) in enumerate(fleet):
            delay = start + i * min(args.interval, args.flood_seconds / 3) / len(fleet) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(report_once, url, context, name, uid, token, 1000, pod_address(i)))
        during = [1000 * f.result()[0] for f in futures]
        loud = [1000 * s for s in reconcile_latencies(plane, "flood", args.reconciles)]
        flood.wait(timeout=args.flood_seconds + 60)
    finally:
        if flood.poll() is None:
            flood.kill()
    operator_cpu = cpu_seconds(operator_pid) - cpu_before
    result = json.loads(out.read_text())
    return {
        "operator_cpu_us_per_request": 1e6 * operator_cpu / max(1, result["sent"]),
        "calm": calm,
        "loud": loud,
        "reports": during,
        "sent_per_s": result["sent"] / result["seconds"],
        "seconds": result["seconds"],
        "not_sent": result["not_sent"],
        "answered": result["answered"],
        "reviews": token_reviews(plane) - reviews_before,
    }


def token_reviews(plane: kube_cluster.ControlPlane) -> int:
    """TokenReviews the API server has answered (its apiserver_request_total for tokenreviews)."""
    return api_requests(plane, 'resource="tokenreviews"')


def status_writes(plane: kube_cluster.ControlPlane) -> int:
    """Writes of TrainingRun status the API server has answered."""
    return api_requests(plane, 'resource="trainingruns"', 'subresource="status"', 'verb="PATCH"')


def api_requests(plane: kube_cluster.ControlPlane, *labels: str) -> int:
    """Requests the API server has answered with all of `labels` (its apiserver_request_total)."""
    text = plane.kubectl("get", "--raw", "/metrics").stdout
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("apiserver_request_total{") and all(label in line for label in labels)
        )
    )


if __name__ == "__main__":
    sys.exit(main())
