"""Following a run from the terminal: `trainingrun status RUN`.

`status_lines` is pure (a TrainingRun as the API server stores it in, lines out), so what a user reads is
tested without a cluster; `read_run` is the one place that talks to the API server, with the `kubernetes`
client so that kubeconfig contexts and exec credential plugins work as they do for kubectl.
"""
from __future__ import annotations

from typing import Any, Optional

from . import api, validation

#: What to install when the `kubernetes` client is missing (the operator's image leaves it out on purpose).
CLIENT_MISSING = ("trainingrun status needs the Kubernetes client: pip install 'trainingrun-operator[cli]' "
                  "(or 'kubernetes<36')")


class RunNotFound(Exception):
    pass


def read_run(name: str, namespace: Optional[str], kubeconfig: Optional[str], context: Optional[str]) -> dict:
    """The TrainingRun as stored, read with the user's kubeconfig (its current context's namespace by default)."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    config.load_kube_config(config_file=kubeconfig, context=context)
    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    chosen = next((c for c in contexts if c["name"] == context), active) if context else active
    namespace = namespace or (chosen.get("context") or {}).get("namespace") or "default"
    with client.ApiClient() as api_client:
        try:
            return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                raise RunNotFound(f"no TrainingRun {name!r} in namespace {namespace!r}; "
                                  f"`kubectl get tr -n {namespace}` lists the runs there") from None
            raise


def status_lines(body: dict[str, Any]) -> list[str]:
    """What `trainingrun status` prints: phase and attempt, progress with an estimate of the time left, goodput
    and restarts, the newest checkpoint, and every condition."""
    meta, status = body.get("metadata") or {}, api.TrainingRunStatus.model_validate(body.get("status") or {})
    head = f"TrainingRun {meta.get('namespace')}/{meta.get('name')}: {status.phase or 'Pending (not seen by the operator yet)'}"
    if status.attempt:
        head += f", attempt {status.attempt}" + (f" (PyTorchJob {status.job_name})" if status.job_name else "")
    lines = [head]
    progress = status.progress
    if progress and progress.step is not None:
        text = f"step {progress.step}"
        if progress.total_steps:
            text += f"/{progress.total_steps} ({100 * progress.step / progress.total_steps:.0f}%)"
        if progress.loss is not None:
            text += f", loss {progress.loss:.4f}"
        if progress.samples_per_second:
            text += f", {progress.samples_per_second:.0f} samples/s"
        left = _time_left(body, status)
        if left is not None and status.phase == "Running":
            text += f", ETA ~{_duration(left)}"
        lines.append(f"  progress    {text}")
    else:
        lines.append("  progress    no step reported yet")
    restarts = status.restarts or api.Restarts()
    goodput = f"{status.goodput:.2f}" if status.goodput is not None else "-"
    lines.append(f"  goodput     {goodput} (restarts: {restarts.failures} failed, {restarts.preemptions} preempted, "
                 f"{restarts.in_place} in place)")
    checkpoint = status.last_good_checkpoint
    if checkpoint and checkpoint.uri:
        lines.append(f"  checkpoint  step {checkpoint.step} at {checkpoint.uri}" + (f" ({checkpoint.time})" if checkpoint.time else ""))
    else:
        lines.append(f"  checkpoint  none committed yet (writes to {status.checkpoint_uri or (body.get('spec') or {}).get('checkpoint', {}).get('uri')})")
    for condition in status.conditions:
        lines.append(f"  condition   {condition.type}={condition.status}"
                     + (f" {condition.reason}" if condition.reason else "")
                     + (f": {condition.message}" if condition.message else ""))
    if status.phase in ("Succeeded", "Failed") and status.completion_time:
        lines.append(f"  ended       {status.completion_time}")
    return lines


def _time_left(body: dict[str, Any], status: api.TrainingRunStatus) -> Optional[float]:
    """Seconds to the last step at the reported throughput; None when the world size can change (elastic)."""
    progress = status.progress
    if not (progress and progress.samples_per_second and progress.total_steps and progress.step is not None):
        return None
    try:
        spec = validation.parse({**body, "status": {}}, from_server=True).spec
    except validation.InvalidTrainingRun:
        return None
    if spec.replicas.effective_max != spec.replicas.min:
        return None
    samples_per_step = (spec.trainer.data.batch_size * spec.trainer.grad_accumulation_steps
                        * spec.nproc_per_node * spec.replicas.min)
    return max(0, progress.total_steps - progress.step) * samples_per_step / progress.samples_per_second


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"

