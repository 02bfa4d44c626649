"""What the operator keeps of each object in memory (runs in `OperatorState.runs`, jobs and pods in
`informer.Index`es), and reading it back.

The indexes are the operator's only view of the cluster between watch events (reconciles make no API reads),
so they hold each run, job and pod slimmed to the fields that reconcile and the report endpoint use.
"""

from __future__ import annotations

import copy
import hmac
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Container, Optional

import orjson

from trainingrun_api import config, nesting
from trainingrun_api.contract import parse_time

from .api import API_VERSION, KIND
from .naming import ANNOTATION_SIGNATURE, job_signature

if TYPE_CHECKING:
    from .backends import Backend


def merged_status(observed: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    status = dict(observed)
    for key, value in written.items():
        if value is None:
            status.pop(key, None)
        else:
            status[key] = value
    return status


def forget_shown(written: dict[str, Any], observed: dict[str, Any]) -> None:
    """Drop from `written` (status fields the operator wrote) those the watch now shows: from then on the server's
    status is the truth. Kept for good, they cost memory with every run and, after a replica stood by while another
    acted, would have put back what it wrote before over what the other wrote since."""
    for key, value in list(written.items()):
        if observed.get(key) == value:  # a field removed (None) shows as absent
            del written[key]


def slim_run(body: Any, before: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What the operator keeps of a run. The spec, with every default the API server filled in, is kept as its
    JSON text: as nested dicts it was most of the operator's memory with thousands of runs. The text of `before`
    (the same run's last event) is reused when the generation is the same: the API server bumps it with every spec
    change, and most events of a run are its status."""
    meta = body.get("metadata", {})
    kept = ("name", "namespace", "uid", "generation", "labels", "annotations", "deletionTimestamp")
    if (
        before is not None
        and meta.get("generation") is not None
        and (before["metadata"].get("uid"), before["metadata"].get("generation"))
        == (meta.get("uid"), meta.get("generation"))
    ):
        spec_json = before[SPEC_JSON]
    else:
        problem = spec_too_deep(body.get("spec") or {})
        spec_json = PROBLEM_PREFIX + problem if problem else orjson.dumps(body.get("spec") or {}).decode()
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: copy.deepcopy(meta[k]) for k in kept if k in meta},
        SPEC_JSON: spec_json,
        "status": copy.deepcopy(body.get("status") or {}),
    }


SPEC_JSON = "specJson"
#: A spec the operator does not keep is kept as this prefix and what is wrong with it (never JSON, which starts with {).
PROBLEM_PREFIX = "!"
#: The deepest spec the operator reads: the typed fields nest at most 6 levels, free-form ones (`initArgs`) at most
#: FREE_FORM_MAX_DEPTH below them; past it the operator does not keep the spec (JSON writers stop at 254 levels).
MAX_SPEC_DEPTH = 32


def spec_too_deep(spec: Any) -> Optional[str]:
    """What is wrong with a spec nested past MAX_SPEC_DEPTH, naming the free-form field it is in; else None."""
    path = nesting.deeper_than(spec, MAX_SPEC_DEPTH)
    if path is None:
        return None
    free_form = next((i + 1 for i, part in enumerate(path) if part == "initArgs"), None)
    if free_form is None:
        return f"spec.{nesting.dotted(path)}: nests deeper than {MAX_SPEC_DEPTH} levels; flatten it"
    return f"spec.{nesting.dotted(path[:free_form])}: {config.free_form_problem(path_value(spec, path[:free_form]))}"


def path_value(value: Any, path: nesting.Path) -> Any:
    for part in path:
        value = value[part]
    return value


def refused_run(meta: dict[str, Any], problem: str, status: dict[str, Any]) -> dict[str, Any]:
    """A run as kept when the operator could not read it (`handlers._skipped`): its plain metadata only, and a spec
    that is `problem` (spec_problem), so that it is refused saying so and never run as it was."""
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "generation") if isinstance(meta.get(k), (str, int))}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": kept,
        SPEC_JSON: PROBLEM_PREFIX + problem,
        "status": status,
    }


def spec_problem(slim: dict[str, Any]) -> Optional[str]:
    """Why the operator did not keep this run's spec (slim_run), or None."""
    text = slim[SPEC_JSON]
    return text[len(PROBLEM_PREFIX) :] if text.startswith(PROBLEM_PREFIX) else None


def view(slim: dict[str, Any], status: dict[str, Any]) -> int:
    """A fingerprint of what a reconcile reads of a run: its metadata, its spec and `status` (merged with the
    operator's own writes). Equal views decide the same (reconcile.decide is a function of them, the children and
    the time), so a watch event that only shows what the last reconcile wrote needs no reconcile."""
    return hash((slim[SPEC_JSON], _canonical(slim.get("metadata")), _canonical(status)))


def job_view(slim: dict[str, Any]) -> int:
    """A fingerprint of a slimmed job (slim_job) but what the server assigns when it creates one (uid,
    creationTimestamp): the job the operator sent and the watch's first event of it have the same view."""
    meta = {k: v for k, v in slim["metadata"].items() if k not in ("uid", "creationTimestamp")}
    return hash(_canonical({**slim, "metadata": meta}))


def _canonical(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def jobs_view(jobs: Any) -> dict[str, int]:
    """Each slimmed job's view (job_view) by its name: what `state.Reconciled.jobs` holds."""
    return {j["metadata"]["name"]: job_view(j) for j in jobs}


def run_document(slim: dict[str, Any]) -> dict[str, Any]:
    """The run as a TrainingRun document again (without status), for parsing."""
    return {
        "apiVersion": slim.get("apiVersion"),
        "kind": slim.get("kind"),
        "metadata": slim.get("metadata") or {},
        "spec": orjson.loads(slim[SPEC_JSON]),
    }


def controller_uid(obj: dict[str, Any]) -> Optional[str]:
    """The uid of the object's controlling owner (ownerReferences with controller: true), if any."""
    return next(
        (ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or [] if ref.get("controller")),
        None,
    )


def run_owns_job(
    job: dict[str, Any],
    run_uid: Optional[str],
    status: dict[str, Any],
    signing_key: bytes,
    since: datetime,
    made: Container[str] = (),
) -> bool:
    """Whether an attempt's job (a PyTorchJob or JobSet) is the run's own: controlled by the run, and made by this
    process (its uid in `made`: the signature follows the creation by one request) or signed by this operator for its uid
    (naming.job_signature), or the one its status (which only the operator writes) named as the current attempt's
    before this process started at `since` (made by an earlier operator: another key, or none). Anyone who may
    create such jobs in the namespace can copy the run's uid into an owner reference, and a signature from another
    job; only the operator signs, and only that job's uid. Without a signing key (tests), the owner reference
    decides."""
    if run_uid is None or controller_uid(job) != run_uid:
        return False
    if not signing_key:
        return True
    meta = job.get("metadata") or {}
    job_uid = str(meta.get("uid") or "")
    if job_uid and job_uid in made:
        return True
    signature = str((meta.get("annotations") or {}).get(ANNOTATION_SIGNATURE) or "")
    if job_uid and hmac.compare_digest(signature, job_signature(signing_key, run_uid, str(meta.get("name")), job_uid)):
        return True
    created, started = parse_time(meta.get("creationTimestamp")), parse_time(status.get("attemptStartTime"))
    return (
        meta.get("name") == status.get("jobName")
        and created is not None
        and started is not None
        and created < since
        and started < since
    )


def slim_job(body: Any, backend: "Backend") -> dict[str, Any]:
    """What the operator keeps of an attempt's job: its metadata here, its spec and status as its backend says."""
    meta = body.get("metadata", {})
    return {
        "kind": backend.kind,
        "metadata": {
            **{
                k: copy.deepcopy(meta.get(k))
                for k in ("name", "uid", "labels", "annotations", "creationTimestamp", "deletionTimestamp")
            },
            "ownerReferences": [{"uid": controller_uid(body), "controller": True}],
        },
        **copy.deepcopy(backend.slim(body)),
    }


def slim_part(body: Any, slim_status: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """What the operator keeps of an object between a job and its pods (a JobSet's Job): who controls it, and what
    its backend reads of its status."""
    meta = body.get("metadata", {})
    return {
        "metadata": {
            **{k: copy.deepcopy(meta.get(k)) for k in ("name", "uid", "labels")},
            "ownerReferences": [{"uid": controller_uid(body), "controller": True}],
        },
        **copy.deepcopy(slim_status(body)),
    }


def slim_pod(body: Any) -> dict[str, Any]:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    return {
        "metadata": {
            **{k: copy.deepcopy(meta.get(k)) for k in ("name", "uid", "labels", "deletionTimestamp")},
            "ownerReferences": [{"uid": controller_uid(body), "controller": True}],
        },
        "spec": {"nodeName": (body.get("spec") or {}).get("nodeName")},  # a node a report names must be one of these
        "status": {
            k: copy.deepcopy(status.get(k)) for k in ("phase", "reason", "message", "conditions", "containerStatuses")
        },
    }
