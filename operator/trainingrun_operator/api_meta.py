"""A TrainingRun's metadata, checked as the API server checks it (part of the API, api.py): the name's length and
form are the operator's own limits, since the run's name prefixes every child's."""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainingrun_api import contract

from .kube_shapes import Annotations, Labels

# Children are named <run>-a<attempt> (PyTorchJob) and Kubeflow names pods and Services
# <job>-worker-<index>; a Service name is a DNS-1035 label of at most 63 characters. 40 leaves room
# for an attempt of up to 4 digits and a replica index of up to 5 digits: 40+2+4+8+5 = 59.
MAX_RUN_NAME_LENGTH = 40
RUN_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: A DNS label (RFC 1123), as the API server checks namespaces.
NAMESPACE_PATTERN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


class ObjectMeta(BaseModel):
    """Kubernetes object metadata: the fields the operator uses, typed and checked as the API server checks
    them, and the rest of ObjectMeta's fields kept as they are; any other field is refused, as the API
    server's strict field validation (kubectl's default) refuses `metadata.lables`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    namespace: str = "default"
    uid: Optional[str] = None
    generation: Optional[int] = None
    labels: Labels = Field(default_factory=dict)
    annotations: Annotations = Field(default_factory=dict)
    generate_name: Optional[str] = Field(default=None, alias="generateName")
    resource_version: Optional[str] = Field(default=None, alias="resourceVersion")
    creation_timestamp: Optional[str] = Field(default=None, alias="creationTimestamp")
    deletion_timestamp: Optional[str] = Field(default=None, alias="deletionTimestamp")
    deletion_grace_period_seconds: Optional[int] = Field(default=None, alias="deletionGracePeriodSeconds")
    finalizers: Optional[list[str]] = None
    owner_references: Optional[list[dict[str, Any]]] = Field(default=None, alias="ownerReferences")
    managed_fields: Optional[list[dict[str, Any]]] = Field(default=None, alias="managedFields")
    self_link: Optional[str] = Field(default=None, alias="selfLink")

    @field_validator("uid")
    @classmethod
    def _uid(cls, value: Optional[str]) -> Optional[str]:
        # The API server sets a UUID; a file's may be anything, and locally it names node memory's folders.
        if value is not None and not re.fullmatch(contract.RUN_KEY_PATTERN, value, re.ASCII):
            raise ValueError(
                f"{value[:80]!r} cannot be a uid: use a UUID (or at most 63 letters, digits and '-'), or leave it out "
                "(trainingrun local makes one)"
            )
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if len(value) > 63 or not re.fullmatch(NAMESPACE_PATTERN, value, re.ASCII):
            raise ValueError(
                f"{value!r} cannot be a namespace: a namespace is a DNS label (at most 63 lowercase letters, digits "
                "and '-', starting and ending with a letter or digit), e.g. 'team-a'; the API server refuses any other"
            )
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > MAX_RUN_NAME_LENGTH:
            raise ValueError(
                f"'{value}' is {len(value)} characters; a TrainingRun name may have at most "
                f"{MAX_RUN_NAME_LENGTH} so that its pods and Services (<name>-a<attempt>-worker-<i>) fit in 63; "
                "choose a shorter name"
            )
        if not re.fullmatch(RUN_NAME_PATTERN, value, re.ASCII):
            raise ValueError(
                f"'{value}' is not a valid name: use lowercase letters, digits and '-', starting with a "
                "letter and ending with a letter or digit (it becomes part of Service names)"
            )
        return value
