"""The `spec.checkpoint` section: where and how often the trainer checkpoints, and which checkpoints it keeps; and
the rules a checkpoint URI follows (the same in `validate`, the CRD's CEL rules and the trainer).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from .model_base import (
    CREDENTIALS_IN_URI,
    NO_CREDENTIALS,
    ApiModel,
    kubernetes_validations,
    refuse_credentials,
)

CHECKPOINT_URI_PATTERN = r"^(gs|s3|file)://.+"
#: A bucket as both GCS and S3 name them: 3-222 lowercase letters, digits, '.', '-', '_'.
BUCKET_URI_PATTERN = r"^(gs|s3)://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/|$)"
#: A checkpoint's step directory: what checkpoint.resumeFrom names.
RESUME_FROM_PATTERN = r"^(gs|s3|file)://[^\s]+/step-[0-9]{8,19}$"
RESUME_FROM_SHAPE = (
    "checkpoint.resumeFrom must be a checkpoint's step directory, gs://, s3:// or file://.../step-NNNNNNNN "
    "(`trainingrun checkpoints URI` lists them)"
)
SAME_STORAGE = "checkpoint.resumeFrom must be on the same storage as checkpoint.uri (the same scheme)"

#: The URI rules as CEL on the checkpoint object, not on the string: for a rule on a string (and for `pattern`)
#: the API server repeats the value in its error, and a URI may hold credentials; for an object it says "object".
CHECKPOINT_URI_RULES = [
    {"rule": f"!self.uri.matches(r'{CREDENTIALS_IN_URI}')", "message": f"checkpoint.uri {NO_CREDENTIALS}"},
    {"rule": "!self.uri.matches(r'\\s')", "message": "checkpoint.uri contains whitespace; remove it"},
    {
        "rule": f"self.uri.matches(r'{CHECKPOINT_URI_PATTERN}')",
        "message": "checkpoint.uri must start with gs://, s3:// or file:// (gs://bucket/path, s3://bucket/path, "
        "file:///path)",
    },
    {
        "rule": f"!self.uri.matches(r'^(gs|s3)://') || self.uri.matches(r'{BUCKET_URI_PATTERN}')",
        "message": "checkpoint.uri needs a bucket name after gs:// or s3:// (3-222 lowercase letters, digits, '.', "
        "'-'): gs://bucket/path",
    },
    {
        "rule": "!self.uri.startsWith('file://') || self.uri.startsWith('file:///')",
        "message": "checkpoint.uri: a file:// URI must be absolute: file:///path",
    },
]


def checkpoint_uri_problem(uri: str) -> Optional[str]:
    """What is wrong with a checkpoint URI, in words that never repeat credentials; None if it is fine."""
    if re.match(CREDENTIALS_IN_URI, uri):
        return NO_CREDENTIALS
    if re.search(r"\s", uri):
        return f"{uri.strip()!r} contains whitespace; remove it"
    if not re.match(CHECKPOINT_URI_PATTERN, uri):
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        found = f"scheme '{scheme}'" if scheme else "no scheme"
        return f"'{uri}' has {found}; use gs://bucket/path, s3://bucket/path or file:///path"
    if re.match(r"^(gs|s3)://", uri) and not re.match(BUCKET_URI_PATTERN, uri):
        return (
            f"'{uri}' has no valid bucket name after the scheme (3-222 lowercase letters, digits, '.', '-'); "
            "write gs://bucket/path or s3://bucket/path"
        )
    if uri.startswith("file://") and not uri.startswith("file:///"):
        return f"'{uri}' is a relative file:// URI; write it absolute: file:///path"
    return None


#: Where a run without spec.checkpoint.uri checkpoints in a pod: its /tmp emptyDir. A trial's default, not a real run's.
POD_DISK_CHECKPOINTS = "file:///tmp/trainingrun/checkpoints"


AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 100_000
AUTO_PRIOR_SECONDS_BETWEEN_FAILURES = 3600
_AUTO_ONLY = ("minSteps", "maxSteps", "expectedSecondsBetweenFailures")


class _StepsOrAuto(ApiModel):
    """An interval whose `steps` is a whole number from 1 or `auto`."""

    @property
    def auto(self) -> bool:
        return getattr(self, "steps", None) == "auto"

    @field_validator("steps", mode="before", check_fields=False)
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"{value!r} is neither a whole number of steps from 1 nor 'auto'; write e.g. 500 or auto")


class CheckpointInterval(_StepsOrAuto):
    """When to checkpoint; whichever limit is reached first triggers a save."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "has(self.steps) || has(self.seconds)",
                    "message": "set checkpoint.interval.steps, checkpoint.interval.seconds or both",
                },
                {
                    "rule": "(has(self.steps) && type(self.steps) == string) || "
                    + " && ".join(f"!has(self.{name})" for name in _AUTO_ONLY),
                    "message": "checkpoint.interval.minSteps, maxSteps and expectedSecondsBetweenFailures only apply "
                    "with steps: auto; remove them or set steps: auto",
                },
                {
                    "rule": "!has(self.minSteps) || !has(self.maxSteps) || self.minSteps <= self.maxSteps",
                    "message": "checkpoint.interval.minSteps is above maxSteps; make minSteps <= maxSteps",
                },
            ]
        )
    )

    steps: Optional[Union[Annotated[int, Field(ge=1)], Literal["auto"]]] = Field(
        default="auto",
        description="Save every this many optimizer steps, or `auto` (the default): the interval that loses the least "
        "training time, sqrt(2 x the measured cost of a save x the run's mean time between failures) (Young/Daly), "
        "within minSteps..maxSteps and never shorter than a commit, except that a maxSteps you set is kept even then "
        "(the trainer then says once that checkpoints wait for commits, and counts the wait). A failure is any restart of the training "
        "processes (crash, preemption, pod loss); until one is seen, expectedSecondsBetweenFailures stands in for the "
        "mean time between them. The first save comes after minSteps, to measure its cost. Persisting behind, a save "
        "costs training almost nothing (it commits in node memory), so auto checkpoints often and losing a worker "
        "costs few steps; storageInterval bounds what reaches storage. status.checkpointInterval shows the choice.",
    )
    seconds: Optional[int] = Field(
        default=None, ge=10, description="Save when this many seconds passed since the last save."
    )
    min_steps: Optional[int] = Field(
        default=None, ge=1, description=f"With steps: auto, the shortest interval (default {AUTO_MIN_STEPS})."
    )
    max_steps: Optional[int] = Field(
        default=None,
        ge=1,
        description=f"With steps: auto, the longest interval (default {AUTO_MAX_STEPS}); kept even when a commit takes "
        "longer (the default gives way to a slow commit).",
    )
    expected_seconds_between_failures: Optional[int] = Field(
        default=None,
        ge=10,
        description="With steps: auto, the mean time between failures assumed until the first one (default "
        f"{AUTO_PRIOR_SECONDS_BETWEEN_FAILURES}, or the time run so far when longer); from then on, the seconds since "
        "the run started / the failures seen.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "CheckpointInterval":
        if self.steps is None and self.seconds is None:
            raise ValueError(
                "neither steps nor seconds is set; set checkpoint.interval.steps, checkpoint.interval.seconds or both"
            )
        given = [
            name
            for name, field in (
                ("minSteps", self.min_steps),
                ("maxSteps", self.max_steps),
                ("expectedSecondsBetweenFailures", self.expected_seconds_between_failures),
            )
            if field is not None
        ]
        if given and not self.auto:
            raise ValueError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with steps: auto; "
                "remove it or set steps: auto"
            )
        if self.min_steps is not None and self.max_steps is not None and self.min_steps > self.max_steps:
            raise ValueError(f"minSteps {self.min_steps} is above maxSteps {self.max_steps}; make minSteps <= maxSteps")
        return self


class StorageInterval(_StepsOrAuto):
    """Persisting behind: how often a checkpoint committed in memory is also copied to storage."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "has(self.steps) || has(self.seconds)",
                    "message": "set checkpoint.storageInterval.steps, checkpoint.storageInterval.seconds or both, or remove "
                    "storageInterval (then every checkpoint in memory is copied, at storage's pace)",
                }
            ]
        )
    )

    steps: Optional[Union[Annotated[int, Field(ge=1)], Literal["auto"]]] = Field(
        default=None,
        description="Copy a memory checkpoint when it is this many steps past the last one copied, or `auto`: the "
        "interval that loses the least training time to pod losses, sqrt(2 x what one copy costs the training loop x "
        "the run's mean time between pod losses) (Young/Daly, as checkpoint.interval's auto), never shorter than a "
        "copy takes. A copy's cost is the slowdown of the steps beside it; a pod loss is a new attempt (its pods "
        "start without the node memory of the last); until the first, the mean time between them is "
        "checkpoint.interval.expectedSecondsBetweenFailures (default "
        f"{AUTO_PRIOR_SECONDS_BETWEEN_FAILURES}) or the time run so far, when longer. Until a copy's cost is measured, "
        "every memory checkpoint is copied. status.checkpointInterval.storageSteps shows the choice.",
    )
    seconds: Optional[int] = Field(
        default=None,
        ge=1,
        description="Copy a memory checkpoint when this many seconds passed since the last copy began.",
    )

    @model_validator(mode="after")
    def _some_limit(self) -> "StorageInterval":
        if self.steps is None and self.seconds is None:
            raise ValueError(
                "neither steps nor seconds is set; set checkpoint.storageInterval.steps, .seconds or both, "
                "or remove storageInterval (then every checkpoint in memory is copied, at storage's pace)"
            )
        return self


class CheckpointConfig(ApiModel):
    """Where and how often the trainer checkpoints, and which checkpoints it keeps."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            CHECKPOINT_URI_RULES
            + [
                {
                    "rule": "!has(self.endpointUrl) || self.uri.startsWith('s3://')",
                    "message": "endpointUrl is only used with s3:// URIs; remove it or use an s3:// uri",
                },
                {
                    "rule": f"!has(self.endpointUrl) || !self.endpointUrl.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"checkpoint.endpointUrl {NO_CREDENTIALS}",
                },
                {
                    "rule": f"!has(self.resumeFrom) || !self.resumeFrom.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"checkpoint.resumeFrom {NO_CREDENTIALS}",
                },
                {
                    "rule": f"!has(self.resumeFrom) || self.resumeFrom.matches(r'{RESUME_FROM_PATTERN}')",
                    "message": RESUME_FROM_SHAPE,
                },
                {
                    "rule": "!has(self.resumeFrom) || "
                    + " || ".join(
                        f"(self.uri.startsWith('{scheme}://') && self.resumeFrom.startsWith('{scheme}://'))"
                        for scheme in ("gs", "s3", "file")
                    ),
                    "message": SAME_STORAGE,
                },
            ]
        )
    )

    uri: str = Field(
        default=POD_DISK_CHECKPOINTS,
        max_length=1024,
        description="Base URI of this run's checkpoints: gs://bucket/path, s3://bucket/path or "
        "file:///path (a volume shared by all pods). The operator never deletes anything here. Default: the pod's "
        f"own disk ({POD_DISK_CHECKPOINTS}, which outlives in-place restarts of the workers but not the pod; "
        "one-pod runs only); under `trainingrun local`, ./runs/<name>/checkpoints.",
    )
    interval: CheckpointInterval = Field(
        default_factory=CheckpointInterval, description="How often to save (persisting behind: to commit in memory)."
    )
    storage_interval: Optional[StorageInterval] = Field(
        default=None,
        description="Persisting behind: how often a checkpoint committed in memory is also copied to storage, which "
        "is what a new pod resumes from (a restart of the workers inside the pod resumes from memory). Unset: every "
        "one, at storage's pace (while one is being copied, the newest waits and replaces any older one waiting). "
        "Set it to bound storage traffic (requests, egress) when checkpoints in memory come every few steps. SIGTERM "
        "and the end of the run copy the newest whatever the interval.",
    )
    keep: int = Field(default=3, ge=1, le=1000, description="Newest checkpoints to keep.")
    keep_every: Optional[int] = Field(
        default=None,
        ge=1,
        description="Also keep every checkpoint whose step is a multiple of this (milestones).",
    )
    async_save: bool = Field(
        default=True, description="Save in the background; training blocks only while state is staged."
    )
    memory_tier: bool = Field(
        default=True,
        description="Also keep the newest committed checkpoint in the pod's memory (/dev/shm, sized by "
        "resources.sharedMemory, counted in the pod's memory): a restart of the workers inside the pod loads it from "
        "there when it is the committed one, file by file verified against its manifest, instead of reading storage. "
        "Skipped, with one warning, while /dev/shm lacks room for it and a reserve.",
    )
    persist_behind: bool = Field(
        default=True,
        description="With memoryTier: a checkpoint commits once every pod's memory holds what its ranks read (each "
        "pod also keeps the other pods' files; a sharded (FSDP2) state on more than two pods its neighbour's), and "
        "rank 0 copies them to checkpoint.uri behind it, at storage's pace, newest first (a checkpoint made while an "
        "older one is still being copied replaces any waiting to be; a sharded state on more than two pods: each pod "
        "copies its own ranks' files and rank 0 commits once all are there). "
        "Training never waits for storage; the update of the step after a save waits for its commit, so a lost pod "
        "costs at most checkpoint.interval steps. A restart of the workers in any pod resumes from the newest "
        "checkpoint in memory, a replacement pod receives it from a surviving pod's memory, and SIGTERM and the end "
        "of the run wait until storage holds the last one. false, or no room in /dev/shm: a checkpoint commits when "
        "storage holds it.",
    )
    writer_process: Optional[bool] = Field(
        default=None,
        description="Deprecated and ignored: the trainer's checkpoint thread writes every checkpoint (the separate "
        "writer process this turned on was slower, and is gone). Remove the field; "
        "`trainingrun validate` and the trainer's log say so while it is set.",
    )
    resume_from: Optional[str] = Field(
        default=None,
        max_length=1024,
        description="Another run's checkpoint to start from when this run has none of its own: its step directory "
        "(<its checkpoint.uri>/step-NNNNNNNN; `trainingrun checkpoints URI` lists them), on the same storage as uri. "
        "Read only: it is verified and loaded (model, optimizer, schedule and step), never rotated or written. To "
        "fine-tune from a run, or to continue a run that was deleted and created again (a run never resumes from "
        "checkpoints another run wrote below its uri without it).",
    )
    endpoint_url: Optional[str] = Field(
        default=None,
        pattern=r"^https?://.+",
        max_length=1024,
        description="Endpoint of an S3-compatible store (MinIO, Ceph, R2); only for s3:// URIs.",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _uri(cls, value: Any) -> Any:
        problem = checkpoint_uri_problem(value) if isinstance(value, str) else None
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("endpoint_url", mode="before")
    @classmethod
    def _endpoint(cls, value: Any) -> Any:
        return refuse_credentials(value, NO_CREDENTIALS)

    @field_validator("resume_from", mode="before")
    @classmethod
    def _resume_from(cls, value: Any) -> Any:
        refuse_credentials(value, NO_CREDENTIALS)
        if isinstance(value, str) and not re.fullmatch(RESUME_FROM_PATTERN, value, re.ASCII):
            raise ValueError(RESUME_FROM_SHAPE.removeprefix("checkpoint.resumeFrom "))
        return value

    @model_validator(mode="after")
    def _resume_from_same_storage(self) -> "CheckpointConfig":
        if self.resume_from and self.resume_from.split("://")[0] != self.uri.split("://")[0]:
            raise ValueError(SAME_STORAGE)
        return self

    @model_validator(mode="after")
    def _endpoint_only_for_s3(self) -> "CheckpointConfig":
        if self.endpoint_url and not self.uri.startswith("s3://"):
            raise ValueError("endpointUrl is only used with s3:// URIs; remove it or use an s3:// uri")
        return self

    def deprecated_fields(self) -> list[str]:
        """A line for each deprecated field that is set, naming it as written under spec.checkpoint, and what to do."""
        if self.writer_process is None:
            return []
        return [
            "spec.checkpoint.writerProcess is deprecated and ignored: the trainer's checkpoint thread writes every "
            "checkpoint; remove the field"
        ]
