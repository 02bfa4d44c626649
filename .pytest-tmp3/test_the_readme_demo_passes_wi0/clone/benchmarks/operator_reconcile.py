"""How fast the operator turns a burst of TrainingRuns into PyTorchJobs, and what it costs in memory.

Starts kmock (the stateful Kubernetes API emulator) in this process and the real operator
(`python -m trainingrun_operator`) as a separate process logged in through a kubeconfig, waits
until it watches, creates N TrainingRuns at once (concurrent POSTs), and records for each the time
from its create call returning to its attempt-1 PyTorchJob appearing in the API. Prints p50/p95
latency, the time until the last job appeared, and the operator's resident memory (now and peak), beside
the same figures for a floor: a bare watcher that POSTs one job per new run (what any controller must pay
here for the burst, most of it kmock's). Each burst gets a fresh kmock; medians of --repeat bursts.
Targets (issue 5): p50 <= 100 ms, all 200 within 20 s, RSS <= 150 MB.

    python benchmarks/operator_reconcile.py [--runs 200] [--repeat 3]

With --real the same is measured against a real control plane (tests/kube_cluster.py, binaries from
$KUBEBUILDER_ASSETS): bursts of 1, 30, 200 and 2,000 runs, p50/p95 create -> PyTorchJob (seen by a watch),
runs admitted per second, RSS (when the last job appeared, 15 s later, and the peak) and CPU per run, the
operator's and the server's (etcd, kube-apiserver, kube-controller-manager), beside the bare-watcher floor
on the same server. On 2 cores the server's CPU per run bounds what any controller can admit: the floor
pays one write per run, the operator three (PyTorchJob, status, Event), and a TrainingRun status
write alone costs the server ~6 ms, more than creating the run. Beside CPU per run until the last job appeared it
prints it settled (15 s later: the status writes and Events that trail the jobs) and the operator's reconciles per
run (its metrics endpoint). With $OPERATOR_PYSPY naming py-spy, the operator is sampled on CPU into
/tmp/operator-<size>.pyspy (collapsed stacks; a few per cent of overhead, where cProfile tripled it). With
$OPERATOR_BREAKDOWN set, the operator times a few of its functions from inside (cpu_breakdown.py: thread CPU, about
2 us a call) and each burst prints their CPU per run beside what each costs a call when warm.
Targets (issue 13): p50 <= 100 ms for 30 at once, >= 100 runs/s with 2,000, RSS <= 150 MB with 2,000.
The `result:` line has `real_cpu_ms_per_run_2000` and `real_settled_rss_mb_2000` (issue 40's figures). Its watches
resume from the last resourceVersion seen when the loaded server drops them (and list again on 410), a create the
server dropped is tried again, and every wait has a deadline: a burst that does not finish prints what it measured,
the reason (`failed_bursts=` in the result line) and exits 1, instead of waiting for ever.

    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/operator_reconcile.py --real [--sizes 1,30,200,2000]

`--held 20000` creates that many runs at a steady pace over `--held-over` seconds (60) instead of at once, the
operator alone, and prints its RSS when the last job appeared and 15 s later, and CPU per run
(`real_settled_rss_mb_20000`, `real_cpu_ms_per_run_20000`; target RSS <= 400 MB).

    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/operator_reconcile.py --real --sizes "" --held 20000
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the resources the operator touches, as the kmock tests declare them
import cpu_breakdown  # noqa: E402  (beside this file)

NAMESPACE = "bench"


def speed_up_kmock() -> None:
    """Make kmock's reaction lookup O(1) per request instead of O(requests so far).

    kmock decides whether a reaction applies to a request with `request in view`, which replays the
    view's filters over the whole request history; with a thousand requests in a burst, kmock (not
    the operator) used ~95% of the CPU (13 s against the operator's 0.5 s for 50 runs). For views
    built only from filters and priorities over the root, which is all this benchmark uses, the
    same answer is `request in source and criteria(request)`. Other views keep kmock's own check.
    """
    from kmock._internal import dsl, rendering

    original = dsl.View.__contains__

    def contains(view, item):
        if isinstance(item, rendering.Request):
            if isinstance(view, dsl.Root):
                return True  # every request arrives at the root first
            if type(view) in (dsl.Priority, dsl.Reaction):
                return contains(view._source, item)
            if type(view) is dsl.Filter:
                return contains(view._source, item) and bool(view.criteria(item))
        return original(view, item)

    dsl.View.__contains__ = contains


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


#: The operator as its image runs it. The image has no `kubernetes` package (the dev venv has it, for the tests'
#: Kubeflow SDK), and kopf imports that library whenever it is installed: ~30 MB of RSS the image does not have.
AS_IN_IMAGE = (
    "import runpy, sys; sys.modules['kubernetes'] = None; "
    "runpy.run_module('trainingrun_operator', run_name='__main__', alter_sys=True)"
)


def operator_command(*args: str) -> list[str]:
    """`python -m trainingrun_operator ARGS` as in the image; under cProfile when $OPERATOR_PROFILE names a file.
    The profile counts CPU time, not wall time: on 2 cores shared with the API server, wall time mostly measures
    when the operator was not scheduled."""
    if os.environ.get("OPERATOR_PROFILE"):
        return [sys.executable, "-c", PROFILED.format(AS_IN_IMAGE, os.environ["OPERATOR_PROFILE"]), *args]
    if os.environ.get("OPERATOR_BREAKDOWN"):
        return [sys.executable, "-c", BROKEN_DOWN + AS_IN_IMAGE, *args]
    return [sys.executable, "-c", AS_IN_IMAGE, *args]


#: The operator with cpu_breakdown's timers, writing to $OPERATOR_BREAKDOWN_OUT (set per burst).
BROKEN_DOWN = (
    "import os, sys; sys.modules['kubernetes'] = None; "  # before anything imports kopf, as AS_IN_IMAGE does
    f"sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import cpu_breakdown; "
    "cpu_breakdown.install(os.environ['OPERATOR_BREAKDOWN_OUT']); "
)


PROFILED = """
import cProfile, signal, sys, time
profile = cProfile.Profile(time.process_time)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    profile.runctx({0!r}, globals(), globals())
finally:
    profile.dump_stats({1!r})
"""


# The floor: the least any controller must do per run here (receive the watch event, POST one job), with
# the same aiohttp client library, against the same kmock on the same cores. No kopf, no children, no status.
FLOOR_WATCHER = """
import asyncio, json, sys, aiohttp
url, namespace = sys.argv[1], sys.argv[2]
async def main():
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer bench"}) as session:
        tasks = set()
        async def create_job(name):
            job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                   "metadata": {"name": name + "-a1", "namespace": namespace}, "spec": {}}
            async with session.post(f"{url}/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs", json=job) as r:
                await r.read()
        async with session.get(f"{url}/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns",
                               params={"watch": "true"}, timeout=aiohttp.ClientTimeout(total=None)) as response:
            async for line in response.content:
                event = json.loads(line)
                if event["type"] == "ADDED":
                    task = asyncio.create_task(create_job(event["object"]["metadata"]["name"]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
asyncio.run(main())
"""


@dataclasses.dataclass
class Burst:
    latencies_ms: list[float]
    total_s: float
    spread_s: float  # how long the creates took to return
    idle_kb: dict[str, int]
    busy_kb: dict[str, int]
    cpu_s: tuple[float, float]  # (controller, kmock + this client)
    settled_kb: dict[str, int] = dataclasses.field(default_factory=dict)  # SETTLE_SECONDS after the last job
    #: The controller's CPU from the burst until SETTLE_SECONDS after its last job: with the status writes and Events
    #: that trail the jobs, and the resyncs in that time.
    settled_cpu_s: float = 0.0
    reconciles: int = 0  #: the operator's reconciles until the last job appeared (0 for the floor)
    settled_reconciles: int = 0  #: and until SETTLE_SECONDS later
    #: Why the burst ended before every job appeared (a deadline, the controller exiting); None: it finished.
    failure: str | None = None
    missing: int = 0  #: runs whose job never appeared
    #: With --real: the controller's CPU a second before the burst, doing nothing (kopf, timers, its watches), and the
    #: wall time settled_cpu_s was taken over: what settled_cpu_s would be without any run is their product.
    idle_cpu_ms_per_s: float = 0.0
    settled_wall_s: float = 0.0
    #: With $OPERATOR_BREAKDOWN: the operator's CPU per run in each timed function, until settled (cpu_breakdown.py).
    breakdown: list[str] = dataclasses.field(default_factory=list)

    def net_settled_cpu_ms_per_run(self, count: int) -> float:
        """The settled CPU a run took beyond the controller's idle CPU over the same time (held runs spread over a
        minute take a minute of idle CPU with them)."""
        return (self.settled_cpu_s - self.idle_cpu_ms_per_s / 1000 * self.settled_wall_s) * 1000 / count

    @classmethod
    def measured(
        cls,
        created: dict[str, float],
        appeared: dict[str, float],
        started: float,
        pid: int,
        idle: dict[str, int],
        cpu_before: tuple[float, float],
    ) -> "Burst":
        """From each run's create time and its job's arrival (time.monotonic()), and the controller's process. Runs
        whose job never appeared are counted in `missing`, not in the latencies."""
        return cls(
            latencies_ms=sorted(max(0.0, appeared[n] - created[n]) * 1000 for n in created if n in appeared) or [0.0],
            total_s=max(appeared.values(), default=started) - started,
            spread_s=max(created.values(), default=0.0) - min(created.values(), default=0.0),
            missing=sum(1 for n in created if n not in appeared),
            idle_kb=idle,
            busy_kb=memory_kb(pid),
            cpu_s=(cpu_seconds(pid) - cpu_before[0], time.process_time() - cpu_before[1]),
        )

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p95(self) -> float:
        return self.latencies_ms[int(0.95 * (len(self.latencies_ms) - 1))]


async def burst(count: int, namespace: str, command: Callable[[str, str], list[str]], workdir: Path) -> Burst:
    """Start a fresh kmock and a controller (`command(kmock_url, namespace)`, with a kubeconfig for kmock),
    wait until it watches TrainingRuns, create `count` runs at once in `namespace`, and time each
    create -> its `<run>-a1` PyTorchJob POST arriving at the API."""
    import kmock as kmock_lib

    from operator_harness import declare_resources, write_kubeconfig

    async with kmock_lib.KubernetesEmulator() as kmock, kmock_lib.Server(kmock):
        declare_resources(kmock)
        url = str(kmock.url).rstrip("/")
        kubeconfig = write_kubeconfig(workdir / "kubeconfig", url, token="bench")
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
            "TRAININGRUN_OPERATOR_HEALTH_PORT": "0",
        }
        return await _burst(kmock, url, count, namespace, command(url, namespace), env, workdir / f"{namespace}.log")


async def _burst(
    kmock, url: str, count: int, namespace: str, command: list[str], env: dict[str, str], log_path: Path
) -> Burst:
    import aiohttp
    import kmock as kmock_lib

    seen_before = len(list(kmock))
    log = open(log_path, "w")
    controller = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not any("watch=true" in str(r.url) and "trainingruns" in str(r.url) for r in list(kmock)[seen_before:]):
            if controller.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"{command} did not start watching")
            await asyncio.sleep(0.05)
        idle = memory_kb(controller.pid)
        cpu_before = cpu_seconds(controller.pid), time.process_time()

        created: dict[str, float] = {}
        appeared: dict[str, float] = {}
        job = kmock_lib.resource("kubeflow.org/v1/pytorchjobs")

        async def create(session: aiohttp.ClientSession, index: int) -> None:
            name = f"run-{index:04d}"
            body = {
                "apiVersion": "trainingrun.dev/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": f"{namespace}-{index}",
                    "resourceVersion": "1",
                },
                "spec": {"checkpoint": {"uri": f"s3://bench/{name}"}},
            }
            async with session.post(
                f"{url}/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns", json=body
            ) as response:
                assert response.status < 300, await response.text()
            created[name] = time.monotonic()

        def record(request) -> bool:
            """Sees every request as it arrives (a criterion that never matches): the jobs' POSTs."""
            if request.method == "POST" and request.resource == job and request.namespace == namespace:
                name = (request.data or {}).get("metadata", {}).get("name", "")
                if name.endswith("-a1"):
                    appeared.setdefault(name[:-3], time.monotonic())
            return False

        kmock[record] << 500

        async def all_appeared() -> None:
            while len(appeared) < count:
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(all_appeared())
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(create(session, i) for i in range(count)))
        await asyncio.wait_for(watcher, 120)
        return Burst.measured(created, appeared, started, controller.pid, idle, cpu_before)
    finally:
        controller.terminate()
        controller.wait(30)
        log.close()


async def main_async(count: int, repeats: int) -> int:
    speed_up_kmock()
    operators: list[Burst] = []
    floors: list[Burst] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):  # alternated, so drift of the machine hits both alike
            operators.append(
                await burst(count, "bench", lambda url, namespace: operator_command("--standalone"), Path(tmp))
            )
            floors.append(
                await burst(
                    count,
                    "bench-floor",
                    lambda url, namespace: [sys.executable, "-c", FLOOR_WATCHER, url, namespace],
                    Path(tmp),
                )
            )

    def median(bursts: list[Burst], figure: Callable[[Burst], float]) -> float:
        return statistics.median(figure(b) for b in bursts)

    p50, floor_p50 = median(operators, lambda b: b.p50), median(floors, lambda b: b.p50)
    p95, floor_p95 = median(operators, lambda b: b.p95), median(floors, lambda b: b.p95)
    total, floor_total = median(operators, lambda b: b.total_s), median(floors, lambda b: b.total_s)
    rss_mb = max(b.busy_kb["VmRSS"] for b in operators) / 1024
    peak_mb = max(b.busy_kb["VmHWM"] for b in operators) / 1024
    print(
        f"{count} TrainingRuns created at once against kmock, each controller in its own process; "
        f"median of {repeats} bursts each (RSS: the largest)"
    )
    print(f"{'':24} {'operator':>10} {'target':>8} {'ratio':>7} {'floor':>10} {'op/floor':>9}")
    for label, value, target, base in (
        ("p50 create->job (ms)", p50, 100, floor_p50),
        ("p95 create->job (ms)", p95, None, floor_p95),
        ("all jobs present (s)", total, 20, floor_total),
        ("RSS (MB)", rss_mb, 150, None),
        ("peak RSS (MB)", peak_mb, 150, None),
    ):
        ratio = f"{value / target:.2f}" if target else "-"
        versus = f"{base:>10.1f} {value / base:>9.2f}" if base else f"{'-':>10} {'-':>9}"
        print(f"{label:24} {value:>10.1f} {target if target else '-':>8} {ratio:>7} {versus}")
    print("floor: a watcher that only POSTs a fixed job per ADDED event (no kopf, no children, no status):")
    print("  the least any controller pays here for a burst, with kmock serving everything on the same cores")
    print(
        "each burst, p50 ms: operator "
        + " ".join(f"{b.p50:.0f}" for b in operators)
        + " | floor "
        + " ".join(f"{b.p50:.0f}" for b in floors)
    )
    print(f"operator RSS before a burst: {operators[0].idle_kb['VmRSS'] / 1024:.1f} MB")
    for label, bursts in (("operator", operators), ("floor", floors)):
        print(
            f"{label}: creates returned over {median(bursts, lambda b: b.spread_s):.2f} s; CPU per burst: controller "
            f"{median(bursts, lambda b: b.cpu_s[0]):.1f} s, kmock + this client {median(bursts, lambda b: b.cpu_s[1]):.1f} s"
        )
    print(
        f"result: p50_ms={p50:.1f} p95_ms={p95:.1f} total_s={total:.2f} rss_mb={rss_mb:.1f} "
        f"floor_p50_ms={floor_p50:.1f}"
    )
    return 0


# ---------------------------------------------------------------- against a real API server (--real)

# The same floor against the real API server: watch TrainingRuns in one namespace, POST a minimal valid
# PyTorchJob per ADDED event, with the admin's client certificate (kubeconfig's files given as arguments), through
# the operator's own API client (kube.Kube over aiohttp's client): what any controller must do per run, on the same stack.
REAL_FLOOR_WATCHER = """
import asyncio, sys, time, kopf
from trainingrun_operator.runtime.kube import ApiError, Kube, WatchGone
url, namespace, ca, cert, key = sys.argv[1:6]
runs = f"/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns"
def job(name):
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name + "-a1", "namespace": namespace},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {"containers": [
                {"name": "pytorch", "image": "trainer"}]}}}}}}
async def main():
    # As any controller must: list, then watch from the list's resourceVersion; after a dropped watch (the server
    # under load closes it) watch again from the last version seen; after 410 Gone list again. Bounded in time.
    kube = Kube(kopf.ConnectionInfo(server=url, ca_path=ca, certificate_path=cert, private_key_path=key))
    tasks, handled, version, ends = set(), set(), None, time.monotonic() + 1800
    def handle(name):
        if name not in handled:
            handled.add(name)
            task = asyncio.create_task(kube.create(job(name)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    print("watching", flush=True)
    while time.monotonic() < ends:
        try:
            if version is None:
                listed = await kube.request("GET", runs)
                for item in listed["items"]:
                    handle(item["metadata"]["name"])
                version = listed["metadata"]["resourceVersion"]
            async for event in kube.watch(f"{runs}?watch=true&resourceVersion={version}&allowWatchBookmarks=true"):
                if event["type"] == "ERROR":
                    break
                version = event["object"]["metadata"].get("resourceVersion", version)
                if event["type"] == "ADDED":
                    handle(event["object"]["metadata"]["name"])
        except WatchGone:
            version = None
        except (ApiError, OSError, ValueError) as error:
            print(f"watch dropped ({type(error).__name__}); watching again from {version}", flush=True)
            await asyncio.sleep(0.2)
asyncio.run(main())
"""


#: With --real, RSS is read again this long after the last job appeared: what holding the runs costs, once the
#: burst's queues have drained.
SETTLE_SECONDS = 15.0
#: With --real, the controller's CPU is read over this long before the burst, with no run yet (its idle CPU).
IDLE_SECONDS = 5.0


async def _until_done(watcher: asyncio.Task, controller: subprocess.Popen, deadline_s: float) -> str | None:
    """Wait for `watcher` (every job seen) for at most `deadline_s`, and no longer than the controller lives: None
    when it finished, else why not (the burst then reports what it has)."""
    ends = time.monotonic() + deadline_s
    while not watcher.done():
        if controller.poll() is not None:
            watcher.cancel()
            return f"the controller exited with {controller.returncode}"
        if time.monotonic() > ends:
            watcher.cancel()
            return f"not every job appeared within {deadline_s:.0f} s"
        await asyncio.sleep(0.1)
    watcher.result()
    return None


def server_cpu_seconds(plane) -> float:
    """CPU used so far by etcd, the API server and the controller manager: what the burst costs the server."""
    return sum(cpu_seconds(process.pid) for process in plane.processes.values())


async def real_burst(
    plane,
    count: int,
    namespace: str,
    command: list[str],
    env: dict[str, str],
    ready_line: str,
    log_path: Path,
    deadline_s: float = 600.0,
    sample_to: str | None = None,
    metrics_port: int = 0,
    spread_over_s: float = 0.0,
) -> Burst:
    """Create `count` TrainingRuns at once in a fresh namespace of the real API server and time each create ->
    its `<run>-a1` PyTorchJob, as seen by a watch on PyTorchJobs opened before the burst."""
    import json as json_lib

    import aiohttp

    plane.create_namespace(namespace)
    context = plane.ssl_context()
    log = open(log_path, "w")
    controller = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_on_controller_cpu)
    sampler = None
    try:
        deadline = time.monotonic() + 90
        while ready_line not in log_path.read_text():
            if controller.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"{command[:3]} did not get ready")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the watches are opened right after that line; give them a moment
        idle = memory_kb(controller.pid)
        idle_cpu = cpu_seconds(controller.pid)
        await asyncio.sleep(IDLE_SECONDS)
        idle_cpu_ms_per_s = (cpu_seconds(controller.pid) - idle_cpu) * 1000 / IDLE_SECONDS
        sampler = _start_sampler(controller.pid, sample_to)
        broken_down = env.get("OPERATOR_BREAKDOWN_OUT", "")
        breakdown_before = cpu_breakdown.read(broken_down) if broken_down else {}
        breakdown: list[str] = []
        cpu_before = cpu_seconds(controller.pid), server_cpu_seconds(plane)
        measured_from = time.monotonic()
        created: dict[str, float] = {}
        appeared: dict[str, float] = {}
        drops: list[str] = []
        refused: list[str] = []  # runs that could not be created
        expected = [count]  # jobs to wait for: the runs created
        connector = aiohttp.TCPConnector(ssl=context, limit=64)
        async with aiohttp.ClientSession(connector=connector) as session:
            watching = asyncio.Event()

            jobs_url = f"{plane.server}/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs"

            def saw(name: str) -> None:
                if name == "probe":
                    watching.set()
                elif name.endswith("-a1"):
                    appeared.setdefault(name[:-3], time.monotonic())

            async def watch_jobs() -> None:
                """Until every run's job was seen. The watch resumes from the last resourceVersion it saw when the
                server drops it (under load it does); a 410 (too old) or a fresh CRD's 504 lists the jobs again
                and watches from there (jobs found by a list count as appearing then). `watching` is set once a
                probe job is seen."""
                version = None
                while len(appeared) < expected[0]:
                    try:
                        if version is None:
                            async with session.get(jobs_url) as response:
                                listed = await response.json()
                            for item in listed.get("items") or []:
                                saw(item["metadata"]["name"])
                            version = listed["metadata"]["resourceVersion"]
                        params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}
                        async with session.get(
                            jobs_url, params=params, timeout=aiohttp.ClientTimeout(total=None)
                        ) as response:
                            async for line in response.content:
                                event = json_lib.loads(line)
                                if event["type"] == "ERROR":
                                    version = None
                                    await asyncio.sleep(0.2)
                                    break
                                version = event["object"]["metadata"].get("resourceVersion", version)
                                if event["type"] == "ADDED":
                                    saw(event["object"]["metadata"].get("name", ""))
                                    if len(appeared) >= expected[0]:
                                        return
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                        drops.append(type(error).__name__)
                        await asyncio.sleep(0.2)

            async def probe() -> None:
                job = {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "metadata": {"name": "probe", "namespace": namespace},
                    "spec": {
                        "pytorchReplicaSpecs": {
                            "Worker": {
                                "replicas": 1,
                                "template": {"spec": {"containers": [{"name": "pytorch", "image": "trainer"}]}},
                            }
                        }
                    },
                }
                url = f"{plane.server}/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs"
                while not watching.is_set():
                    async with session.post(url, json=job) as response:
                        await response.read()
                    await asyncio.sleep(0.3)
                    async with session.delete(f"{url}/probe") as response:
                        await response.read()

            async def create(index: int) -> None:
                await asyncio.sleep(index * spread_over_s / count)  # held, not bursted: created at a steady pace
                name = f"run-{index:04d}"
                body = run_body(name, namespace)
                url = f"{plane.server}/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns"
                for _ in range(3):  # a connection the loaded server dropped is tried again; 409: it got there
                    try:
                        async with session.post(url, json=body) as response:
                            if response.status < 300 or response.status == 409:
                                created.setdefault(name, time.monotonic())
                                return
                            reason = f"{response.status} {(await response.text())[:200]}"
                    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                        reason = type(error).__name__
                    await asyncio.sleep(0.5)
                refused.append(f"{name}: {reason}")

            watcher = asyncio.create_task(watch_jobs())
            await asyncio.wait_for(probe(), 60)
            started = time.monotonic()
            await asyncio.gather(*(create(i) for i in range(count)))
            expected[0] = len(created)
            failure = await _until_done(watcher, controller, deadline_s)
            if refused:
                failure = f"{len(refused)} runs could not be created (first: {refused[0]})" + (
                    f"; {failure}" if failure else ""
                )
        if drops:
            print(
                f"  the job watch was dropped {len(drops)} times ({', '.join(sorted(set(drops)))}); resumed", flush=True
            )
        burst = Burst.measured(created, appeared, started, controller.pid, idle, cpu_before)
        burst = dataclasses.replace(
            burst,
            cpu_s=(burst.cpu_s[0], server_cpu_seconds(plane) - cpu_before[1]),
            failure=failure,
            reconciles=await _reconciles(metrics_port),
        )
        if failure is None:
            await asyncio.sleep(SETTLE_SECONDS)  # status writes and Events trail the jobs; then the runs just exist
        alive = controller.poll() is None
        if broken_down and alive:
            await asyncio.sleep(1.0)  # the timers are written every half second
            breakdown = cpu_breakdown.table(breakdown_before, cpu_breakdown.read(broken_down), count, BASELINE_COSTS)
        return dataclasses.replace(
            burst,
            settled_kb=memory_kb(controller.pid) if alive else {},
            settled_cpu_s=cpu_seconds(controller.pid) - cpu_before[0] if alive else 0.0,
            settled_reconciles=await _reconciles(metrics_port) if alive else 0,
            idle_cpu_ms_per_s=idle_cpu_ms_per_s,
            settled_wall_s=time.monotonic() - measured_from,
            breakdown=breakdown,
        )
    finally:
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            sampler.wait(60)
        controller.terminate()
        controller.wait(30)
        log.close()


async def _reconciles(port: int) -> int:
    """Reconciles the operator has done so far (its metrics endpoint on `port`; 0 when it has none)."""
    if not port:
        return 0
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            text = await response.text()
    count = "trainingrun_operator_reconcile_duration_seconds_count"
    return int(float(next(row for row in text.splitlines() if row.startswith(count)).split()[-1]))


def _start_sampler(pid: int, output: str | None) -> subprocess.Popen | None:
    """py-spy sampling `pid` on CPU (not idle) into `output`, collapsed stacks; $OPERATOR_PYSPY names py-spy. A
    sampler costs the operator a few per cent where cProfile tripled its CPU per run."""
    py_spy = os.environ.get("OPERATOR_PYSPY")
    if not output or not py_spy:
        return None
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--nonblocking", "--rate", "200", "--format", "raw", "-o", output],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_body(name: str, namespace: str) -> dict:
    """Each TrainingRun of a real burst: the least a run needs (a checkpoint URI), every default taken."""
    return {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"checkpoint": {"uri": f"s3://bench/{name}"}},
    }


#: With $OPERATOR_BREAKDOWN: what the timed functions cost a call warm and cold, on a run of the burst.
BASELINE_COSTS: dict[str, tuple[float, float]] = {}


#: With --controller-cpu: the CPU the measured controller (operator or floor) runs on, every other process elsewhere.
CONTROLLER_CPU: int | None = None


def _on_controller_cpu() -> None:
    if CONTROLLER_CPU is not None:
        os.sched_setaffinity(0, {CONTROLLER_CPU})


async def main_real(sizes: list[int], held: list[int], held_over_s: float) -> int:
    """Every size once against one real control plane (a fresh namespace per burst, the operator watching only
    it), the operator beside the floor; then each `held` size, created over `held_over_s`, the operator alone."""
    import kube_cluster

    rows = []
    kept: dict[int, Burst] = {}
    if os.environ.get("OPERATOR_BREAKDOWN"):
        BASELINE_COSTS.update(cpu_breakdown.baseline_costs(run_body("run-0000", "bench")))
    with tempfile.TemporaryDirectory() as tmp:
        plane = kube_cluster.started_for_benchmark(Path(tmp))
        try:
            env = plane.operator_env()
            pki = plane.pki

            async def operator_burst(count: int, namespace: str, **options) -> Burst:
                metrics_port = kube_cluster.free_port()
                broken_down = {"OPERATOR_BREAKDOWN_OUT": f"{tmp}/{namespace}.breakdown.json"}
                return await real_burst(
                    plane,
                    count,
                    namespace,
                    operator_command("--standalone", "-n", namespace),
                    {
                        **env,
                        "TRAININGRUN_OPERATOR_METRICS_PORT": str(metrics_port),
                        **(broken_down if os.environ.get("OPERATOR_BREAKDOWN") else {}),
                    },
                    "PyTorchJob CRD (kubeflow.org/v1) is served",
                    Path(tmp) / f"{namespace}.log",
                    metrics_port=metrics_port,
                    **options,
                )

            for count in sizes:
                namespace = f"bench-{count}"
                operator = await operator_burst(
                    count,
                    namespace,
                    sample_to=os.environ.get("OPERATOR_PYSPY_OUT", "/tmp/operator-{count}.pyspy").format(count=count),
                )
                floor = await real_burst(
                    plane,
                    count,
                    namespace + "-floor",
                    [
                        sys.executable,
                        "-c",
                        REAL_FLOOR_WATCHER,
                        plane.server,
                        namespace + "-floor",
                        str(pki / "ca.crt"),
                        str(pki / "admin.crt"),
                        str(pki / "admin.key"),
                    ],
                    env,
                    "watching",
                    Path(tmp) / f"{namespace}-floor.log",
                )
                rows.append((count, operator, floor))
                print(f"  {count} runs: operator p50 {operator.p50:.0f} ms, floor p50 {floor.p50:.0f} ms", flush=True)
            for count in held:
                kept[count] = await operator_burst(
                    count, f"held-{count}", deadline_s=max(600.0, count / 10), spread_over_s=held_over_s
                )
                print(f"  {count} runs held: the last job after {kept[count].total_s:.0f} s", flush=True)
        finally:
            plane.stop()
    print(
        f"TrainingRuns created at once against a real kube-apiserver v1.36 (etcd, {os.cpu_count()} cores shared with it); the "
        "operator (admin kubeconfig, watching the burst's namespace) beside the floor (a bare watcher POSTing one "
        "job per run)"
    )
    print(
        f"{'runs':>6} {'p50 ms':>8} {'p95 ms':>8} {'runs/s':>8} {'RSS MB':>7} {'settled':>7} {'peak':>6} "
        f"{'CPU ms/run':>10} {'settled':>7} {'rec/run':>5} {'settl':>5} {'server':>7} | "
        f"{'floor p50':>9} {'floor p95':>9} {'floor runs/s':>12} {'CPU ms/run':>10} {'server':>7} | {'p50 ratio':>9}"
    )

    def mb(kb: dict[str, int], key: str) -> float:
        return kb.get(key, 0) / 1024

    for count, op, fl in rows:
        print(
            f"{count:>6} {op.p50:>8.0f} {op.p95:>8.0f} {count / max(op.total_s, 1e-9):>8.1f} "
            f"{mb(op.busy_kb, 'VmRSS'):>7.1f} {mb(op.settled_kb, 'VmRSS'):>7.1f} {mb(op.settled_kb, 'VmHWM'):>6.1f} "
            f"{op.cpu_s[0] * 1000 / count:>10.1f} {op.settled_cpu_s * 1000 / count:>7.1f} "
            f"{op.reconciles / count:>5.1f} {op.settled_reconciles / count:>5.1f} "
            f"{op.cpu_s[1] * 1000 / count:>7.1f} | {fl.p50:>9.0f} {fl.p95:>9.0f} "
            f"{count / max(fl.total_s, 1e-9):>12.1f} {fl.cpu_s[0] * 1000 / count:>10.1f} {fl.cpu_s[1] * 1000 / count:>7.1f} | "
            f"{op.p50 / max(fl.p50, 0.001):>9.2f}"
        )
        for side, burst in (("operator", op), ("floor", fl)):
            if burst.failure:
                print(
                    f"       {side}: {burst.failure}; {burst.missing} of {count} jobs missing (figures above: the rest)"
                )
    print(
        f"RSS MB: when the last job appeared; settled: {SETTLE_SECONDS:.0f} s later; peak: the process's high-water mark"
    )
    print(
        "CPU ms/run: the controller's until the last job appeared; settled: until 15 s later (trailing status writes, "
        "Events, resyncs); rec/run: the operator's reconciles per run until the last job appeared, settl: until 15 s "
        "later; server: etcd, kube-apiserver and kube-controller-manager together"
    )
    print("targets: p50 <= 100 ms for 30 at once; >= 100 runs/s admitted with 2,000; RSS <= 150 MB with 2,000")
    for label, burst in [(f"{count} at once", op) for count, op, _ in rows] + [
        (f"{count} held", op) for count, op in kept.items()
    ]:
        if burst.breakdown:
            print(
                f"where the operator's CPU went, {label} (until settled; nested functions overlap; cpu_breakdown.py):"
            )
            print("\n".join(burst.breakdown))
    by_size = {count: op for count, op, _ in rows}
    figures = []
    for count in (1, 30, 200):
        if count in by_size:
            figures.append(f"real_p50_ms_{count}={by_size[count].p50:.1f}")
    if 2000 in by_size:
        figures += [
            f"real_runs_per_s_2000={2000 / max(by_size[2000].total_s, 1e-9):.1f}",
            f"real_rss_mb_2000={mb(by_size[2000].busy_kb, 'VmRSS'):.1f}",
            f"real_settled_rss_mb_2000={mb(by_size[2000].settled_kb, 'VmRSS'):.1f}",
            f"real_cpu_ms_per_run_2000={by_size[2000].cpu_s[0] * 1000 / 2000:.2f}",
            f"real_settled_cpu_ms_per_run_2000={by_size[2000].settled_cpu_s * 1000 / 2000:.2f}",
            f"real_reconciles_per_run_2000={by_size[2000].reconciles / 2000:.2f}",
        ]
    for count, op in kept.items():
        print(
            f"held: {count} runs created over {held_over_s:.0f} s: every job after {op.total_s:.0f} s, p50 "
            f"{op.p50:.0f} ms; RSS {mb(op.busy_kb, 'VmRSS'):.1f} MB at the last job, {mb(op.settled_kb, 'VmRSS'):.1f} "
            f"settled (peak {mb(op.settled_kb, 'VmHWM'):.1f}); CPU {op.cpu_s[0] * 1000 / count:.2f} ms/run "
            f"({op.settled_cpu_s * 1000 / count:.2f} settled, {op.net_settled_cpu_ms_per_run(count):.2f} beyond the "
            f"{op.idle_cpu_ms_per_s:.1f} ms/s it takes idle); {op.settled_reconciles / count:.2f} reconciles/run"
            + (f"; FAILED: {op.failure}" if op.failure else "")
        )
        figures += [
            f"real_settled_rss_mb_{count}={mb(op.settled_kb, 'VmRSS'):.1f}",
            f"real_cpu_ms_per_run_{count}={op.cpu_s[0] * 1000 / count:.2f}",
        ]
    failed = [f"{count}:{side}" for count, op, fl in rows for side, b in (("operator", op), ("floor", fl)) if b.failure]
    failed += [f"{count}:held" for count, op in kept.items() if op.failure]
    if failed:
        figures.append(f"failed_bursts={','.join(failed)}")
    print("result: " + " ".join(figures))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="bursts per controller (medians are printed)")
    parser.add_argument(
        "--real",
        action="store_true",
        help="against a real kube-apiserver started from $KUBEBUILDER_ASSETS, bursts of --sizes",
    )
    parser.add_argument("--sizes", default="1,30,200,2000", help="with --real: burst sizes, comma-separated")
    parser.add_argument(
        "--held", default="", help="with --real: sizes created at a steady pace over --held-over seconds (20000)"
    )
    parser.add_argument("--held-over", type=float, default=60.0)
    parser.add_argument(
        "--controller-cpu",
        type=int,
        help="run the measured controller alone on this CPU and the API server, etcd and this script on the others: "
        "its CPU per run then varies less between runs (on 2 cores shared, the same code measured 2.3 to 5 ms)",
    )
    args = parser.parse_args()
    if args.controller_cpu is not None:
        global CONTROLLER_CPU
        CONTROLLER_CPU = args.controller_cpu
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {CONTROLLER_CPU})  # the control plane started later too
    # Killed (e.g. by `timeout`), still stop the control plane: its processes run in sessions of their own and
    # would otherwise go on taking CPU from every later measurement.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.real:
        return asyncio.run(
            main_real(
                [int(n) for n in args.sizes.split(",") if n],
                [int(n) for n in args.held.split(",") if n],
                args.held_over,
            )
        )
    return asyncio.run(main_async(args.runs, args.repeat))


if __name__ == "__main__":
    sys.exit(main())
