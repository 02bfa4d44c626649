"""Following a run from the terminal: `trainingrun status RUN` and `trainingrun logs RUN [-f]`.

`status_lines` is pure (a TrainingRun as the API server stores it in, lines out) and `follow_logs` takes its
cluster as a `LogSource`, so what a user reads is tested without a cluster; `KubeSource` is
the only part that talks to the API server, with the `kubernetes` client so that kubeconfig contexts and exec
credential plugins work as they do for kubectl.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Optional, Protocol, TextIO

from trainingrun_api import contract

from . import api, api_status, jobset, naming, validation

#: What to install when the `kubernetes` client is missing (the operator's image leaves it out on purpose).
CLIENT_MISSING = (
    "trainingrun status and logs need the Kubernetes client: pip install 'trainingrun-operator[cli]' "
    "(or 'kubernetes<36')"
)


class RunNotFound(Exception):
    pass


class NothingToShow(Exception):
    """No log to show (yet): the pod has not started, or the run has no such pod."""


class KubeSource:
    """A run and its pods on the cluster of the user's kubeconfig (its context's namespace by default)."""

    def __init__(self, name: str, namespace: Optional[str], kubeconfig: Optional[str], context: Optional[str]):
        from kubernetes import client, config

        config.load_kube_config(config_file=kubeconfig, context=context)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), active) if context else active
        self.name = name
        self.namespace = namespace or (chosen.get("context") or {}).get("namespace") or "default"
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()

    def run(self) -> dict:
        from kubernetes.client.rest import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name
            )
        except ApiException as error:
            if error.status == 404:
                raise RunNotFound(
                    f"no TrainingRun {self.name!r} in namespace {self.namespace!r}; "
                    f"`kubectl get tr -n {self.namespace}` lists the runs there"
                ) from None
            raise

    def container(self, pod: str) -> Optional[tuple[str, str]]:
        """(an identity of the pod's trainer container, 'running' or 'terminated'); None while it has not started."""
        from kubernetes.client.rest import ApiException

        try:
            found = self.core.read_namespaced_pod(pod, self.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        for status in found.status.container_statuses or []:
            if status.name == naming.CONTAINER_NAME:
                state = "running" if status.state.running else "terminated" if status.state.terminated else None
                return (f"{found.metadata.uid}/{status.restart_count}", state) if state else None
        return None

    def worker_pod(self, attempt: int, index: int) -> Optional[str]:
        """The newest pod of worker `index` of the run's attempt, by its labels: a JobSet's pods are named by the Job
        controller, `<jobset>-worker-0-<index>-<random>`, and a replaced one gets a new name."""
        selector = (
            f"{naming.LABEL_RUN}={self.name},{naming.LABEL_ATTEMPT}={attempt},{jobset.COMPLETION_INDEX_LABEL}={index}"
        )
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        pods.sort(key=lambda p: (p.metadata.deletion_timestamp is None, p.metadata.creation_timestamp))
        return pods[-1].metadata.name if pods else None

    def lines(self, pod: str, follow: bool) -> Iterable[str]:
        """The container's log; followed, it ends when the container does."""
        from kubernetes import watch

        if not follow:  # Watch.stream always follows; raw bytes, as the client would parse a log that looks like JSON
            response = self.core.read_namespaced_pod_log(
                pod, self.namespace, container=naming.CONTAINER_NAME, _preload_content=False
            )
            yield from response.data.decode("utf-8", "replace").splitlines()
            return
        yield from watch.Watch().stream(
            self.core.read_namespaced_pod_log, name=pod, namespace=self.namespace, container=naming.CONTAINER_NAME
        )


class LogSource(Protocol):
    def run(self) -> dict: ...
    def worker_pod(self, attempt: int, index: int) -> Optional[str]: ...
    def container(self, pod: str) -> Optional[tuple[str, str]]: ...
    def lines(self, pod: str, follow: bool) -> Iterable[str]: ...


ENDED = ("Succeeded", "Failed")


def _spec(body: dict[str, Any]) -> api.TrainingRunSpec:
    """The spec of a TrainingRun as the API server stored it (defaults filled in)."""
    return validation.parse({**body, "status": {}}, from_server=True).spec


def follow_logs(
    source: LogSource,
    pod_index: int = 0,
    attempt: Optional[int] = None,
    follow: bool = False,
    out: Optional[TextIO] = None,
    wait: Callable[[float], None] = time.sleep,
    poll_seconds: float = 1.0,
) -> int:
    """Print the trainer log of Worker pod `pod_index`: of the current attempt, or of `attempt`. With `follow`, go
    on across the pod's restarts and (unless an attempt is given) into each next attempt's pod, until the run
    ends. A header line marks each container shown. By pod, not by rank: the elastic rendezvous assigns ranks
    anew at every restart, so a rank can move to another pod (each log line names its rank)."""
    import sys

    out = out or sys.stdout
    body = source.run()
    name = str((body.get("metadata") or {}).get("name") or "")
    spec = _spec(body)
    if pod_index >= spec.replicas.effective_max:
        raise NothingToShow(
            f"--pod {pod_index}: the run has at most {spec.replicas.effective_max} pod(s), "
            f"0 to {spec.replicas.effective_max - 1}"
        )
    shown_attempt, shown, waiting_for = attempt, None, None
    while True:
        status = body.get("status") or {}
        current = status.get("attempt")
        if shown_attempt is None or (follow and attempt is None and current and current > shown_attempt):
            shown_attempt = current
        pod = _worker_pod(source, status, name, shown_attempt, pod_index) if shown_attempt else None
        container = source.container(pod) if pod else None
        if pod and container and (shown is None or container[0] != shown[0]):
            print(f"==> attempt {shown_attempt}, pod {pod} <==", file=out, flush=True)
            for line in source.lines(pod, follow and container[1] == "running"):
                print(line, file=out, flush=True)
            if not follow:
                return 0
            shown, waiting_for = container, None
        elif status.get("phase") in ENDED and (current == shown_attempt or attempt is not None):
            print(f"==> run {status['phase']} in attempt {current} <==", file=out, flush=True)
            return 0
        elif attempt is not None and current and current > attempt:
            print(f"==> attempt {attempt} is over (the run is in attempt {current}) <==", file=out, flush=True)
            return 0
        elif not follow:
            raise NothingToShow(
                f"pod {pod or name + '-a?-worker-' + str(pod_index)} has not started yet; add -f to wait for it"
            )
        else:
            if waiting_for != pod:
                print(
                    f"==> {pod} ended; waiting for it to restart or for the next attempt <=="
                    if shown and container
                    else f"==> waiting for pod {pod} (attempt {shown_attempt}) <==",
                    file=out,
                    flush=True,
                )
                waiting_for = pod
            wait(poll_seconds)
        body = source.run()


#: How the trainer starts each line of a hang's diagnosis (hangs.py): the summary, then its details indented.
HANG_DIAGNOSIS = "hang diagnosis: "


def last_hang(source: LogSource, out: Optional[TextIO] = None) -> int:
    """Print the whole diagnosis of the run's last hang (status.lastHang): the `hang diagnosis:` lines of the pod
    of the current attempt that logged the newest one; status's one line where no pod's log still has them."""
    import sys

    out = out or sys.stdout
    body = source.run()
    name = str((body.get("metadata") or {}).get("name") or "")
    status = body.get("status") or {}
    hang = status.get("lastHang")
    if not hang:
        raise NothingToShow(f"{name} has had no hang (status.lastHang is empty)")
    newest: tuple[str, str, list[str]] = ("", "", [])  # (its summary line, pod, its lines)
    attempt = int(status.get("attempt") or 0)
    for index in range(_spec(body).replicas.effective_max if attempt else 0):
        pod = _worker_pod(source, status, name, attempt, index)
        if not pod or not source.container(pod):
            continue
        lines = [line for line in source.lines(pod, False) if HANG_DIAGNOSIS in line]
        starts = [i for i, line in enumerate(lines) if HANG_DIAGNOSIS + "hang" in line]
        if starts and lines[starts[-1]] > newest[0]:  # lines start with their time: the later sorts last
            block = lines[starts[-1] :]
            ends = next((i for i, line in enumerate(block[1:], 1) if HANG_DIAGNOSIS + "hang" in line), len(block))
            newest = (lines[starts[-1]], pod, block[:ends])
    print(f"==> the last hang: after step {hang.get('step')}, diagnosed {hang.get('time')} <==", file=out)
    if not newest[2]:
        print(f"{hang.get('diagnosis')}\n(no pod of attempt {attempt} still logs the details)", file=out)
        return 0
    print(f"==> pod {newest[1]} <==", file=out)
    for line in newest[2]:
        print(line.split(HANG_DIAGNOSIS, 1)[1], file=out)
    return 0


def _worker_pod(source: LogSource, status: dict[str, Any], name: str, attempt: int, index: int) -> Optional[str]:
    """Worker `index`'s pod in `attempt`: Kubeflow names it (`<job>-worker-<index>`); a JobSet's is looked up."""
    if status.get("backend") == jobset.KIND:
        return source.worker_pod(attempt, index)
    return naming.worker_pod(name, attempt, index)


def status_lines(body: dict[str, Any], now: Optional[datetime] = None) -> list[str]:
    """What `trainingrun status` prints: phase and attempt, progress with the operator's estimate of the time left,
    goodput and restarts, the newest checkpoint, and every condition."""
    meta, status = body.get("metadata") or {}, api_status.TrainingRunStatus.model_validate(body.get("status") or {})
    head = f"TrainingRun {meta.get('namespace')}/{meta.get('name')}: {status.phase or 'Pending (not seen by the operator yet)'}"
    if status.attempt:
        kind = status.backend or "PyTorchJob"
        head += f", attempt {status.attempt}" + (f" ({kind} {status.job_name})" if status.job_name else "")
    lines = [head]
    progress = status.progress
    if progress and progress.step is not None:
        text = f"step {progress.step}"
        if progress.total_steps:
            percent = progress.percent if progress.percent is not None else 100 * progress.step / progress.total_steps
            text += f"/{progress.total_steps} ({percent:.0f}%)"
        if progress.loss is not None:
            text += f", loss {progress.loss:.4f}"
        if progress.samples_per_second:
            text += f", {progress.samples_per_second:.0f} samples/s"
        if progress.model_flops_per_second:
            text += f", {progress.model_flops_per_second / 1e12:.3g} TFLOP/s"
            if progress.mfu is not None:
                text += f" (MFU {progress.mfu:.0%})"
        # The operator's estimate, from the step rate between reports (world size changes included): one figure
        # for status, the kubectl column and this line.
        eta = contract.parse_time(progress.estimated_completion_time or "")
        if eta and status.phase == "Running":
            left = max(0.0, (eta - (now or datetime.now(timezone.utc))).total_seconds())
            text += f", ETA ~{_duration(left)} ({progress.estimated_completion_time})"
        lines.append(f"  progress    {text}")
    else:
        lines.append("  progress    no step reported yet")
    restarts = status.restarts or api_status.Restarts()
    goodput = f"{status.goodput:.2f}" if status.goodput is not None else "-"
    lines.append(
        f"  goodput     {goodput} (restarts: {restarts.failures} failed, {restarts.preemptions} preempted, "
        f"{restarts.in_place} in place)"
    )
    checkpoint = status.last_good_checkpoint
    if checkpoint and checkpoint.uri:
        lines.append(
            f"  checkpoint  step {checkpoint.step} at {checkpoint.uri}"
            + (f" ({checkpoint.time})" if checkpoint.time else "")
        )
    else:
        lines.append(
            f"  checkpoint  none committed yet (writes to {status.checkpoint_uri or (body.get('spec') or {}).get('checkpoint', {}).get('uri')})"
        )
    in_memory = status.checkpoint_in_memory
    if (
        in_memory
        and in_memory.step is not None
        and (checkpoint is None or checkpoint.step is None or in_memory.step > checkpoint.step)
    ):
        lines.append(
            f"  in memory   step {in_memory.step}"
            + (f" ({in_memory.time})" if in_memory.time else "")
            + ", not in storage yet: a restart inside the pod resumes from it"
        )
    for condition in status.conditions:
        lines.append(
            f"  condition   {condition.type}={condition.status}"
            + (f" {condition.reason}" if condition.reason else "")
            + (f": {condition.message}" if condition.message else "")
        )
    if status.phase in ENDED and status.completion_time:
        lines.append(f"  ended       {status.completion_time}")
    return lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
