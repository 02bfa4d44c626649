"""What an attempt becomes, one module per backend: `pytorchjob` (a Kubeflow PyTorchJob) and `jobset` (a JobSet). Each
says what an attempt's objects are and how their state reads; reconcile, plans and handlers use them through a
`Backend`, so a third (Kubeflow Trainer v2's TrainJob, once its API settles) is one more module and one more entry
in BACKENDS.

Which backend a run uses is decided once, at its first attempt, and kept in status.backend: spec.backend, else the
operator's default (Settings.backend; `auto`: PyTorchJob when its CRD is served at start, else JobSet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional

from . import api, jobset, pytorchjob
from .settings import Settings

#: (how many more pods were replaced, the status.restarts fields that record them, what happened), or None.
Replaced = Optional[tuple[int, dict[str, Any], str]]
#: The objects between a job and its pods: (apiVersion, kind, what the operator keeps of one's status).
Part = tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]]]


@dataclass(frozen=True)
class Backend:
    """One backend: what an attempt's objects are and how their state reads. Every function is pure."""

    kind: str  #: the attempt's object's kind; the run's spec.backend word
    api_version: str
    plural: str
    #: How to install what serves it, for the messages that say it is missing.
    install: str
    #: Who replaces a lost pod within an attempt, for the Events that say so.
    replacer: str
    #: (run, attempt, settings, resume_from, checkpoint_uri) -> the attempt's objects, the job last.
    children: Callable[..., list[dict[str, Any]]]
    #: (job, the attempt's pods) -> Succeeded, Failed, Suspended, Running, Restarting, Created or None.
    state: Callable[[dict[str, Any], list[dict[str, Any]]], Optional[str]]
    #: (job, its parts, status.restarts) -> pods replaced within the attempt since status last counted.
    pods_replaced: Callable[[dict[str, Any], list[dict[str, Any]], dict[str, Any]], Replaced]
    #: The merge patch that suspends a job.
    suspend_patch: Callable[[], dict[str, Any]]
    #: A job as the watch gives it -> the spec and status the operator keeps (indexes.slim_job adds the metadata).
    slim: Callable[[dict[str, Any]], dict[str, Any]]
    #: The objects between the job and its pods (a JobSet's batch Jobs), which the operator also watches: their kind
    #: and what it keeps of their status; None when the job controls its pods itself.
    part: Optional[Part] = None

    def names(self, job_name: str) -> str:
        """How messages name an attempt's job: `PyTorchJob demo-a1`."""
        return f"{self.kind} {job_name}"


def _of(module: Any, replacer: str, part: Optional[Part] = None) -> Backend:
    """A backend from its module, which defines what every backend module does: KIND, API_VERSION, PLURAL, INSTALL,
    children, state, pods_replaced, suspend_patch and slim."""
    return Backend(
        kind=module.KIND,
        api_version=module.API_VERSION,
        plural=module.PLURAL,
        install=module.INSTALL,
        replacer=replacer,
        children=module.children,
        state=module.state,
        pods_replaced=module.pods_replaced,
        suspend_patch=module.suspend_patch,
        slim=module.slim,
        part=part,
    )


PYTORCHJOB = _of(pytorchjob, replacer="Kubeflow")
JOBSET = _of(jobset, replacer="its Job", part=("batch/v1", "Job", jobset.slim_part))
#: By kind, in the order `auto` prefers them.
BACKENDS: dict[str, Backend] = {b.kind: b for b in (PYTORCHJOB, JOBSET)}
assert tuple(BACKENDS) == api.BACKENDS
#: Every kind an attempt's job may be (plans._ensure never changes one, and signs it).
JOB_KINDS = frozenset(BACKENDS)


@dataclass(frozen=True)
class Choice:
    """Which backends this operator runs, decided at start (`choose`)."""

    default: Backend  #: for runs whose spec.backend is empty
    usable: tuple[Backend, ...]  #: the ones runs may ask for, which the operator watches

    def of(self, spec_backend: Optional[str], status: dict[str, Any]) -> Backend:
        """A run's backend: the one its status recorded at its first attempt (a run from before status recorded it,
        with an attempt, ran PyTorchJobs), else its spec's, else the default."""
        recorded = status.get("backend") or (PYTORCHJOB.kind if status.get("jobName") else None)
        return BACKENDS.get(recorded or spec_backend or "", self.default)

    def problem(self, backend: Backend) -> Optional[str]:
        """Why a run cannot use `backend` with this operator, naming the field and the fix; None when it can."""
        if backend in self.usable:
            return None
        allowed = " or ".join(b.kind for b in self.usable)
        return (
            f"spec.backend {backend.kind}: this operator runs {allowed} only (its setting TRAININGRUN_BACKEND, the chart "
            f"value backend, and the CRDs served when it started); set spec.backend to {allowed}, or {backend.install}, "
            f"set the chart value backend to auto or {backend.kind} and restart the operator"
        )


def choose(settings: Settings, served: Collection[str]) -> Choice:
    """The backends this operator runs: the one Settings.backend names, or with `auto` each whose CRD is
    `served` (kinds) at start, the default being the first of BACKENDS served (PyTorchJob when both are, as before
    JobSet existed; PyTorchJob when none is, and readiness says what to install)."""
    if settings.backend in BACKENDS:
        only = BACKENDS[settings.backend]
        return Choice(only, (only,))
    usable = tuple(b for b in BACKENDS.values() if b.kind in served)
    return Choice(usable[0] if usable else PYTORCHJOB, usable or (PYTORCHJOB,))
