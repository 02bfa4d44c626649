"""What losing a pod costs on a real cluster: time from a worker pod's deletion to the run training again,
and the steps lost, beside the time from `kubectl apply` to the first step.

Starts the end-to-end tier's cluster (tests/kube_journey.py: a real control plane and node, the real
Kubeflow Training Operator, our chart with `helm install`, moto's S3 on the node's address), applies
the journey's 2-pod CPU TrainingRun (logging every step), waits until a checkpoint is committed and
rank 0 has reported twice, deletes a worker pod and follows the recovery by polling the API (every
0.1 s) and reading the pods' logs (the trainer's lines carry millisecond timestamps; one machine, one
clock). Phases of deletion -> training again:
  detection    deletion -> the replacement pod exists (Kubeflow saw the pod go and created it again)
               or, when Kubeflow gave up, -> our operator's next attempt's job exists (our decision)
  pod start    replacement created -> its container running
  rendezvous   container running -> every rank restored from the checkpoint ("resumed from ...")
  + restore
  first step   restored -> the first step after it
Lost steps: the last step any rank trained before the deletion minus the step training resumed from.
Status lag: how long after a first step (the first of the run, and the first after the resume, from the logs)
`kubectl get tr` shows it: the run's status is read every 0.1 s in the background, and a start shows when
status.processTime names the new process (its first step's report) with that step or later.
Targets: deletion -> training again <= 10 s on this machine (issue 14); lost steps <= one checkpoint
interval; status shows training within 2 s of the first step (issue 36).

`--loss kill` loses the pod without warning instead (every process SIGSTOPped, the pod force-deleted, then
SIGKILLed: tests/kube_journey.lose_without_warning), with checkpoints in memory every 5 steps. `--backends
PyTorchJob,JobSet` runs on a cluster with both Kubeflow and JobSet installed, the runs naming their backend in turn
(alternating, `--repeat` each), and prints each backend's medians side by side with their ratio (issue 79: JobSet
no slower than PyTorchJob).

Needs root, the node's packages and the image archives (as `make e2e`):
    KUBEBUILDER_ASSETS=.tools/k8s python benchmarks/cluster_recovery.py [--pod 0|1] [--repeat 1] [--loss delete|kill]
        [--backends PyTorchJob[,JobSet]]
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import kube_journey  # noqa: E402
from kube_journey import CHECKPOINT_STEPS, Cluster  # noqa: E402

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank(\d+) \w+ ([\w.]+): (.*)$")


def parse_lines(text: str) -> list[tuple[float, int, str, str]]:
    """(epoch seconds, rank, logger, message) of each trainer log line (UTC in the container and here)."""
    out = []
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            when = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.timezone.utc)
            out.append((when.timestamp(), int(match[2]), match[3], match[4]))
    return out


def step_of_message(message: str) -> Optional[int]:
    match = re.match(r"step (\d+)/\d+ ", message)
    return int(match[1]) if match else None


def pods(cluster: Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    answer = cluster.get(f"/api/v1/namespaces/{namespace}/pods")
    return {p["metadata"]["name"]: p for p in answer.get("items", [])}


def running(pod: dict[str, Any]) -> bool:
    return any("running" in (s.get("state") or {}) for s in (pod.get("status") or {}).get("containerStatuses") or [])


class StatusSampler:
    """Reads the run's status every 0.1 s until stopped: (time, progress.step, processTime.current.process)."""

    def __init__(self, read: Any):
        self.read, self.samples, self.stop = read, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(0.1):
            try:
                status = self.read().get("status") or {}
            except Exception:  # noqa: BLE001 - a failed read is a gap in the samples, not a failed benchmark
                continue
            current = (status.get("processTime") or {}).get("current") or {}
            self.samples.append((time.time(), (status.get("progress") or {}).get("step"), current.get("process")))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    def shows_training(self, after: float, since_step: int, before_process: Optional[str]) -> float:
        """When status first named a process other than `before_process` at step `since_step` or later, after
        `after` (the process that trains again has reported its first step)."""
        return min(
            (
                t
                for t, step, process in self.samples
                if t >= after and process and process != before_process and step is not None and step >= since_step
            ),
            default=float("nan"),
        )

    def process_at(self, when: float) -> Optional[str]:
        return next((process for t, _, process in reversed(self.samples) if t <= when), None)


def index_pod(cluster: Cluster, namespace: str, attempt: int, index: int) -> Optional[dict[str, Any]]:
    """Worker `index`'s newest pod of the attempt (Kubeflow's or a JobSet's Job's), by its labels."""
    found = cluster.worker_pods(namespace, "bench", attempt, index)
    return found[-1] if found else None


def one_loss(
    cluster: Cluster,
    index: int,
    logs_dir: Optional[Path] = None,
    agent_log_level: str = "",
    backend: str = "PyTorchJob",
    loss: str = "delete",
) -> dict[str, float]:
    namespace = cluster.plane.create_namespace(f"bench-{uuid.uuid4().hex[:6]}")
    cluster.create_s3_secret(namespace)
    document = kube_journey.run_file(cluster.s3.new_bucket(), "bench", cluster.s3.endpoint_url)
    document["spec"]["trainer"]["logIntervalSteps"] = 1
    document["spec"]["backend"] = backend
    if loss == "kill":  # the newest checkpoint in the pods' memory: a replacement restores it from its peer
        document["spec"]["checkpoint"]["interval"] = {"steps": 5}
        document["spec"]["checkpoint"]["storageInterval"] = {"steps": CHECKPOINT_STEPS}
    if agent_log_level:  # torch's elastic agent logs its rendezvous rounds and worker starts at INFO
        document["spec"].setdefault("env", []).append({"name": "LOGLEVEL", "value": agent_log_level})
    path = Path(cluster.plane.workdir) / f"{namespace}.yaml"
    path.write_text(yaml.safe_dump(document))
    applied = time.time()
    cluster.kubectl("-n", namespace, "apply", "-f", str(path))
    explain = lambda: cluster.diagnose(namespace)  # noqa: E731
    run = lambda: cluster.run(namespace, "bench")  # noqa: E731
    sampler = StatusSampler(run)
    cluster.wait(
        "a committed checkpoint", lambda: (run().get("status") or {}).get("lastGoodCheckpoint"), explain=explain
    )
    reported = (run()["status"].get("progress") or {}).get("updatedAt")
    cluster.wait(
        "a second report", lambda: (run()["status"].get("progress") or {}).get("updatedAt") != reported, explain=explain
    )
    status = run()["status"]
    attempt = status["attempt"]
    assert status["backend"] == backend, status
    victim = cluster.worker_pod(namespace, "bench", attempt, index)
    survivor = cluster.worker_pod(namespace, "bench", attempt, 1 - index)
    old_uid = pods(cluster, namespace)[victim]["metadata"]["uid"]
    # Follow both pods' logs to their end: a pod Kubeflow replaces takes its log with it.
    followers = [
        subprocess.Popen(
            [
                str(cluster.plane.assets / "kubectl"),
                f"--kubeconfig={cluster.plane.admin_kubeconfig}",
                "-n",
                namespace,
                "logs",
                "-f",
                name,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in (victim, survivor)
    ]

    deleted = time.time()
    if loss == "kill":
        kube_journey.lose_without_warning(cluster, namespace, victim)
    else:
        cluster.kubectl("-n", namespace, "delete", "pod", victim, "--wait=false")
    replaced = started = None
    deadline = time.monotonic() + kube_journey.DEADLINE_S
    while started is None:
        now = time.time()
        now_status = run().get("status") or {}
        new_job = now_status.get("attempt", attempt) != attempt
        # the lost pod's replacement: in the attempt (Kubeflow's or the Job's), or in our operator's next one
        pod = index_pod(cluster, namespace, now_status.get("attempt", attempt), index)
        replacement = pod is not None and pod["metadata"]["uid"] != old_uid
        if replaced is None and (replacement or new_job):
            replaced = now
        if replaced is not None and replacement and running(pod):
            started = now
        assert time.monotonic() < deadline, explain()
        time.sleep(0.1)  # polling the API
    cluster.wait(
        "Succeeded", lambda: (run().get("status") or {}).get("phase") in ("Succeeded", "Failed"), explain=explain
    )
    sampler.close()
    assert run()["status"]["phase"] == "Succeeded", explain()

    before_logs = []
    for follower in followers:
        out, _ = follower.communicate(timeout=60)
        before_logs += parse_lines(out)
    first_step = min(t for t, _, logger, m in before_logs if logger == "trainingrun.trainer" and step_of_message(m))
    lines = []
    for name in pods(cluster, namespace):
        lines += parse_lines(cluster.kubectl("-n", namespace, "logs", name, check=False).stdout)
    lines.sort()
    resumes = [(t, m) for t, _, logger, m in lines if t >= deleted and m.startswith("resumed from ")]
    assert resumes, explain()
    # Trained before the resume, by the old processes (they may go on for a moment after the deletion call).
    before = [
        step_of_message(m)
        for t, _, logger, m in lines + before_logs
        if t < resumes[0][0] and logger == "trainingrun.trainer" and step_of_message(m)
    ]
    restored = max(t for t, _ in resumes)
    resumed_step = int(re.search(r"at step (\d+)", resumes[0][1])[1])
    training = min(
        t for t, _, logger, m in lines if t > restored and logger == "trainingrun.trainer" and step_of_message(m)
    )
    first_shown = sampler.shows_training(applied, 1, None)
    resumed_shown = sampler.shows_training(deleted, resumed_step + 1, sampler.process_at(deleted))
    if logs_dir:
        for name in pods(cluster, namespace):
            (logs_dir / f"{namespace}-{name}.log").write_text(
                cluster.kubectl("-n", namespace, "logs", name, check=False).stdout
            )
        (logs_dir / f"{namespace}-survivor-before.log").write_text("\n".join(map(str, before_logs)))
        (logs_dir / f"{namespace}-times.txt").write_text(
            f"applied {applied}\ndeleted {deleted}\nreplaced {replaced}\nstarted {started}\n"
        )
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    return {
        "apply_to_first_step_s": first_step - applied,
        "detection_s": replaced - deleted,
        "pod_start_s": started - replaced,
        "rendezvous_restore_s": restored - started,
        "first_step_s": training - restored,
        "deletion_to_training_s": training - deleted,
        "first_step_to_status_s": first_shown - first_step,
        "resumed_step_to_status_s": resumed_shown - training,
        "lost_steps": max(before) - resumed_step,
        "new_attempt": float(run()["status"]["attempt"] != attempt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pod", type=int, choices=(0, 1), default=0, help="worker deleted (0 hosts the rendezvous)")
    parser.add_argument("--loss", choices=("delete", "kill"), default="delete", help="how the pod is lost")
    parser.add_argument(
        "--backends",
        default="PyTorchJob",
        help="comma-separated: PyTorchJob, JobSet or both (alternating runs, side by side)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs, each losing one pod; medians printed")
    parser.add_argument("--logs", type=Path, help="keep each run's pod logs and timestamps in this folder")
    parser.add_argument(
        "--agent-log-level",
        default="",
        help="LOGLEVEL for torch's elastic agent in the pods (INFO shows its rendezvous rounds in the --logs files)",
    )
    args = parser.parse_args()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"PyTorchJob", "JobSet"}:
        sys.exit("cluster_recovery: --backends takes PyTorchJob, JobSet or both, comma-separated")
    gaps = kube_journey.missing()
    if gaps:
        sys.exit("cluster_recovery: missing " + "; ".join(gaps))
    by_backend: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
    with (
        tempfile.TemporaryDirectory(prefix="cluster-recovery-") as workdir,
        kube_journey.started(Path(workdir), backends[0] if len(backends) == 1 else "both") as cluster,
    ):
        kube_journey.install_chart(cluster)
        for _ in range(args.repeat):
            for backend in backends:  # alternating: a slow spell of the machine falls on both
                by_backend[backend].append(
                    one_loss(cluster, args.pod, args.logs, args.agent_log_level, backend, args.loss)
                )
    keys = list(by_backend[backends[0]][0])
    verb = "deleted" if args.loss == "delete" else "lost without warning"
    for backend, runs in by_backend.items():
        print(f"{backend}: worker-{args.pod} {verb}, {len(runs)} run(s); median [each]")
        for key in keys:
            values = [r[key] for r in runs]
            print(f"  {key:24s} {statistics.median(values):8.2f}   {' '.join(f'{v:.2f}' for v in values)}")
    if len(backends) == 2:
        first, second = ({k: statistics.median(r[k] for r in by_backend[b]) for k in keys} for b in backends)
        print(
            f"side by side (medians): {'':18s} {backends[0]:>10s} {backends[1]:>10s}  ratio {backends[1]}/{backends[0]}"
        )
        for key in keys:
            ratio = f"{second[key] / first[key]:.2f}" if first[key] else "-"
            print(f"  {key:24s} {first[key]:18.2f} {second[key]:10.2f}  {ratio}")
    for backend, runs in by_backend.items():
        median = {key: statistics.median(r[key] for r in runs) for key in keys}
        lag = max(median["first_step_to_status_s"], median["resumed_step_to_status_s"])
        print(
            f"{backend}: target deletion_to_training_s <= 10: "
            f"{'met' if median['deletion_to_training_s'] <= 10 else 'NOT met'}; "
            f"lost_steps <= {CHECKPOINT_STEPS}: {'met' if median['lost_steps'] <= CHECKPOINT_STEPS else 'NOT met'}; "
            f"status within 2 s of a first step: {'met' if lag <= 2 else 'NOT met'}"
        )
        print(
            f"result: backend={backend} loss={args.loss} apply_to_first_step_s={median['apply_to_first_step_s']:.1f} "
            f"deletion_to_training_s={median['deletion_to_training_s']:.1f} lost_steps={median['lost_steps']:.0f} "
            f"first_step_to_status_s={median['first_step_to_status_s']:.1f} "
            f"resumed_step_to_status_s={median['resumed_step_to_status_s']:.1f} "
            f"checkpoint_interval_steps={CHECKPOINT_STEPS}"
        )


if __name__ == "__main__":
    main()
