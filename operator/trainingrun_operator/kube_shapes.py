"""Kubernetes' own shapes that a TrainingRun passes on to its pods (labels, annotations, node selectors, tolerations,
affinity), checked by Kubernetes' own rules, and the affinity that keeps a run off nodes it hung on.

Labels, annotations, node selectors, tolerations and affinity end up in the pod template of every
attempt. A value the API server refuses there would pass `validate`, pass the TrainingRun CRD and
fail only when the Kubeflow operator creates pods, so each rule of k8s.io/apimachinery's validation
(qualified names, label values, annotation size) and of the core/v1 Pod validation (tolerations,
node and pod affinity) is written here once, as a pydantic check for `validate` and the operator
and, where the API server's CEL can express it within its cost budget, as a CRD rule.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import AfterValidator, Field, field_validator, model_validator

from trainingrun_api.model_base import ApiModel

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A qualified name (label and annotation keys, toleration keys): an optional DNS-subdomain prefix and '/',
#: then a name of 1-63 characters. Two expressions, as RE2 has no look-ahead: shape, then lengths.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
QUALIFIED_NAME_LENGTHS = r"^(.{1,253}/)?[^/]{1,63}$"
MAX_ANNOTATIONS_BYTES = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB


def annotations_bytes(annotations: dict[str, str]) -> int:
    """What the API server counts against MAX_ANNOTATIONS_BYTES: keys and values together."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


#: Most entries in a label, selector or annotation map. With maxProperties the CEL key rules fit the API
#: server's cost budget; without it the server refused them (estimated cost 1.5x the budget).
MAX_MAP_ENTRIES = 64

#: Pod labels the operator or the Kubeflow Training Operator set; a user value would be overwritten or
#: would break how they find their pods.
RESERVED_LABEL_PREFIXES = ("trainingrun.dev/", "training.kubeflow.org/")
RESERVED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)


def qualified_name_problem(key: str) -> Optional[str]:
    """Why `key` is not a Kubernetes qualified name, or None."""
    if re.fullmatch(QUALIFIED_NAME, key, re.ASCII) and re.fullmatch(QUALIFIED_NAME_LENGTHS, key, re.ASCII):
        return None
    return (
        f"key {key!r} is not a valid Kubernetes key: an optional DNS prefix (lowercase, at most 253 "
        "characters) and '/', then at most 63 letters, digits, '-', '_' or '.', starting and ending with a "
        "letter or digit"
    )


def label_value_problem(key: str, value: str) -> Optional[str]:
    if len(value) <= 63 and re.fullmatch(LABEL_VALUE, value, re.ASCII):
        return None
    return (
        f"the value of {key!r} is not a valid label value: at most 63 letters, digits, '-', '_' or '.', "
        "starting and ending with a letter or digit (or empty)"
    )


def check_labels(labels: dict[str, str], reserved: bool = False) -> dict[str, str]:
    """Raise ValueError naming the first bad key or value (validators of every label-like map use this)."""
    for key, value in labels.items():
        problem = qualified_name_problem(key) or label_value_problem(key, value)
        if problem:
            raise ValueError(problem + "; fix or remove it")
        if reserved and (key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABELS):
            raise ValueError(
                f"label {key!r} is set by the operator or the Kubeflow Training Operator; choose another key"
            )
    return labels


def check_annotations(annotations: dict[str, str]) -> dict[str, str]:
    for key in annotations:
        problem = qualified_name_problem(key)
        if problem:
            raise ValueError(problem + "; fix or remove it")
    size = annotations_bytes(annotations)
    if size > MAX_ANNOTATIONS_BYTES:
        raise ValueError(
            f"annotations total {size} bytes; Kubernetes allows at most {MAX_ANNOTATIONS_BYTES}: "
            "shorten them, or put large data in a ConfigMap"
        )
    return annotations


def _qualified(key: str) -> str:
    problem = qualified_name_problem(key)
    if problem:
        raise ValueError(problem)
    return key


#: Field types that carry Kubernetes' rules (pydantic checks them; the CRD gets bounds and patterns from them).
QualifiedName = Annotated[str, Field(max_length=317), AfterValidator(_qualified)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
Labels = Annotated[dict[str, str], AfterValidator(check_labels)]
PodLabels = Annotated[dict[str, LabelValue], AfterValidator(functools.partial(check_labels, reserved=True))]
NodeSelectorLabels = Annotated[dict[str, LabelValue], AfterValidator(check_labels)]
Annotations = Annotated[dict[str, str], AfterValidator(check_annotations)]


def _keys_rule(what: str) -> dict[str, Any]:
    return {
        "rule": f"self.all(k, k.matches(r'{QUALIFIED_NAME}') && k.matches(r'{QUALIFIED_NAME_LENGTHS}'))",
        "message": f"{what}: every key must be a Kubernetes qualified name (optional DNS prefix and '/', then "
        "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)",
    }


def label_map_schema(what: str, reserved: bool = False) -> dict[str, Any]:
    """CRD schema extras for a map of labels: key rule and, for pod labels, the reserved keys."""
    rules = [_keys_rule(what)]
    if reserved:
        prefixes = " || ".join(f"k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES)
        exact = ", ".join(f"'{k}'" for k in RESERVED_LABELS)
        rules.append(
            {
                "rule": f"self.all(k, !({prefixes} || k in [{exact}]))",
                "message": f"{what}: keys under trainingrun.dev/ and training.kubeflow.org/ and the "
                "app.kubernetes.io/ labels are set by the operators; choose another key",
            }
        )
    return {"x-kubernetes-validations": rules}


def annotation_map_schema(what: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [_keys_rule(what)]}


# ---------------------------------------------------------------- tolerations


class Toleration(ApiModel):
    """A Kubernetes toleration, as in a pod spec."""

    model_config = {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "self.operator != 'Exists' || !has(self.value) || self.value == ''",
                    "message": "tolerations: value must be empty when operator is Exists",
                },
                {
                    "rule": "has(self.key) && self.key != '' || self.operator == 'Exists'",
                    "message": "tolerations: operator must be Exists when key is empty (that matches every taint)",
                },
                {
                    "rule": "!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
                    "message": "tolerations: tolerationSeconds needs effect NoExecute",
                },
                {
                    "rule": f"!has(self.key) || self.key == '' || self.key.matches(r'{QUALIFIED_NAME}') && "
                    f"self.key.matches(r'{QUALIFIED_NAME_LENGTHS}')",
                    "message": "tolerations: key must be a Kubernetes qualified name (an optional DNS prefix and '/', then at "
                    "most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)",
                },
            ]
        }
    }

    key: Optional[str] = Field(
        default=None, max_length=317, description="Taint key; empty matches all keys with Exists."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Optional[str] = Field(default=None, max_length=63, pattern=LABEL_VALUE, description="Taint value for Equal.")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        default=None, description="Taint effect to match; empty matches all."
    )
    toleration_seconds: Optional[int] = Field(
        default=None, ge=0, description="For NoExecute: how long the pod stays bound after the taint appears."
    )

    @field_validator("key")
    @classmethod
    def _key(cls, key: Optional[str]) -> Optional[str]:
        return _qualified(key) if key else key  # empty: every key (with Exists)

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists; remove value or use Equal")
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty (that matches every taint); set a key")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute; set effect: NoExecute or remove it")
        return self


# ---------------------------------------------------------------- affinity (core/v1 Affinity)

_SET_OPERATORS = ("In", "NotIn")


def requirement_problem(key: str, operator: str, values: list[str]) -> Optional[str]:
    """Why a label/node selector requirement is refused (core/v1 validation), or None."""
    if operator in _SET_OPERATORS and not values:
        return f"operator {operator} needs values; add them"
    if operator in ("Exists", "DoesNotExist") and values:
        return f"operator {operator} takes no values; remove them"
    if operator in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?[0-9]+", values[0], re.ASCII)):
        return f"operator {operator} needs exactly one integer value"
    for value in values if operator in _SET_OPERATORS else ():
        problem = label_value_problem(key, value)
        if problem:
            return problem
    return None


class NodeSelectorRequirement(ApiModel):
    """A node label requirement."""

    key: QualifiedName = Field(description="Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="How key and values relate."
    )
    values: list[str] = Field(
        default_factory=list, max_length=64, description="Values for In/NotIn; one integer for Gt/Lt."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "NodeSelectorRequirement":
        problem = requirement_problem(self.key, self.operator, self.values)
        if problem:
            raise ValueError(problem)
        return self


class NodeSelectorTerm(ApiModel):
    """Requirements that must all hold (terms are ORed)."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Node label requirements."
    )
    match_fields: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Node field requirements (metadata.name)."
    )


class NodeSelector(ApiModel):
    """Terms of which at least one must match."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=64, description="ORed terms.")


class PreferredSchedulingTerm(ApiModel):
    """A weighted node preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1-100.")
    preference: NodeSelectorTerm = Field(description="The preferred node term.")


class NodeAffinity(ApiModel):
    """Which nodes the pods may or prefer to run on."""

    required_during_scheduling_ignored_during_execution: Optional[NodeSelector] = Field(
        default=None, description="Nodes the pods must run on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=64, description="Nodes the pods prefer."
    )


class LabelSelectorRequirement(ApiModel):
    """A pod label requirement."""

    key: QualifiedName = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How key and values relate.")
    values: list[str] = Field(default_factory=list, max_length=64, description="Values for In/NotIn.")

    @model_validator(mode="after")
    def _consistent(self) -> "LabelSelectorRequirement":
        problem = requirement_problem(self.key, self.operator, self.values)
        if problem:
            raise ValueError(problem)
        return self


class LabelSelector(ApiModel):
    """Selects pods by labels."""

    match_labels: Labels = Field(default_factory=dict, max_length=MAX_MAP_ENTRIES, description="Exact labels.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Label requirements."
    )


class PodAffinityTerm(ApiModel):
    """Pods (by labels, in namespaces) to be near or away from, per topology domain."""

    label_selector: Optional[LabelSelector] = Field(default=None, description="Pods this term is about.")
    namespace_selector: Optional[LabelSelector] = Field(default=None, description="Namespaces of those pods.")
    namespaces: list[str] = Field(default_factory=list, max_length=64, description="Namespace names.")
    topology_key: QualifiedName = Field(min_length=1, description="Node label that defines a domain.")
    match_label_keys: list[str] = Field(default_factory=list, max_length=64, description="Keys merged from the pod.")
    mismatch_label_keys: list[str] = Field(
        default_factory=list, max_length=64, description="Keys excluded from the pod."
    )


class WeightedPodAffinityTerm(ApiModel):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1-100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(ApiModel):
    """Pods to be scheduled near (affinity) or away from (anti-affinity)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=64, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=64, description="Terms preferred."
    )


class Affinity(ApiModel):
    """Pod affinity, as in a pod spec (core/v1 Affinity)."""

    node_affinity: Optional[NodeAffinity] = Field(default=None, description="Node affinity.")
    pod_affinity: Optional[PodAffinity] = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: Optional[PodAffinity] = Field(default=None, description="Pod anti-affinity.")


#: The most nodes a run avoids (status.avoidedNodes); the oldest go first.
MAX_AVOIDED_NODES = 16


def avoiding(affinity: Optional[dict[str, Any]], nodes: Sequence[str]) -> Optional[dict[str, Any]]:
    """`affinity` (a pod spec's, as the wire has it) that also keeps the pods off `nodes` (by node name): the
    requirement is added to every required node selector term (terms are ORed), or is the one term."""
    if not nodes:
        return affinity
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": sorted(set(nodes))}
    changed = copy.deepcopy(affinity or {})
    node_affinity = changed.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchFields"] = [*(term.get("matchFields") or []), avoid]
    required["nodeSelectorTerms"] = terms
    return changed
