"""What the operator keeps of each object in kopf's in-memory indexes, and reading it back.

The indexes are the operator's only view of the cluster between watch events (reconciles make no API reads),
so they hold each run, job and pod slimmed to the fields that reconcile and the report endpoint use.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Optional


def merged_status(observed: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    status = dict(observed)
    for key, value in written.items():
        if value is None:
            status.pop(key, None)
        else:
            status[key] = value
    return status


def slim_run(body: Any) -> dict[str, Any]:
    """What the index keeps of a run. The spec, with every default the API server filled in, is kept as its
    JSON text: as nested dicts it was most of the operator's memory with thousands of runs."""
    meta = body.get("metadata", {})
    kept = ("name", "namespace", "uid", "generation", "labels", "annotations", "deletionTimestamp")
    return {
        "apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
        "metadata": {k: copy.deepcopy(meta[k]) for k in kept if k in meta},
        SPEC_JSON: json.dumps(body.get("spec") or {}, separators=(",", ":")),
        "status": copy.deepcopy(body.get("status") or {}),
    }


SPEC_JSON = "specJson"


def run_document(slim: dict[str, Any]) -> dict[str, Any]:
    """The run as a TrainingRun document again (without status), for parsing."""
    return {"apiVersion": slim.get("apiVersion"), "kind": slim.get("kind"), "metadata": slim.get("metadata") or {},
            "spec": json.loads(slim[SPEC_JSON])}


def controller_uid(obj: dict[str, Any]) -> Optional[str]:
    """The uid of the object's controlling owner (ownerReferences with controller: true), if any."""
    return next((ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
                 if ref.get("controller")), None)


def slim_job(body: Any) -> dict[str, Any]:
    meta = body.get("metadata", {})
    return {
        "metadata": {**{k: copy.deepcopy(meta.get(k)) for k in ("name", "uid", "labels", "annotations",
                                                                 "deletionTimestamp")},
                     "ownerReferences": [{"uid": controller_uid(body), "controller": True}]},
        "spec": {"runPolicy": {"suspend": ((body.get("spec") or {}).get("runPolicy") or {}).get("suspend")}},
        "status": {"conditions": copy.deepcopy((body.get("status") or {}).get("conditions") or [])},
    }


def slim_pod(body: Any) -> dict[str, Any]:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    return {
        "metadata": {**{k: copy.deepcopy(meta.get(k)) for k in ("name", "uid", "labels", "deletionTimestamp")},
                     "ownerReferences": [{"uid": controller_uid(body), "controller": True}]},
        "status": {k: copy.deepcopy(status.get(k)) for k in ("reason", "message", "conditions", "containerStatuses")},
    }
