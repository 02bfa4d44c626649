"""Generate the TrainingRun CustomResourceDefinition from the pydantic models in `api.py`.

Pydantic emits JSON Schema (draft 2020-12); a CRD needs a *structural* OpenAPI v3.0 schema: no
$ref, nullable instead of `anyOf [X, null]`, boolean exclusive bounds, and
`x-kubernetes-preserve-unknown-fields` where free-form objects are allowed. `structural()` does that
translation; everything else (descriptions, defaults, enums, bounds, CEL rules) comes from the models.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from . import api, api_meta, api_status

_DROPPED_KEYS = {"title", "additionalProperties"}
_PASSED_KEYS = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
}


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON-Schema node (with its `$defs`) into a structural OpenAPI node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        outer = {k: v for k, v in schema.items() if k != "$ref"}
        return structural({**target, **outer}, defs)
    if "anyOf" in schema:
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        if sorted(b.get("type") for b in branches) == ["integer", "string"]:
            return _int_or_string(schema, branches)
        if len(branches) != 1:
            raise ValueError(f"unions other than Optional[X] cannot be expressed in a CRD: {schema}")
        outer = {k: v for k, v in schema.items() if k != "anyOf"}
        node = structural({**branches[0], **outer}, defs)
        node["nullable"] = True
        return node

    out: dict[str, Any] = {k: v for k, v in schema.items() if k in _PASSED_KEYS or k.startswith("x-kubernetes-")}
    if out.get("default", 0) is None:
        del out["default"]
    if "const" in schema:
        out["enum"] = [schema["const"]]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in schema:
            out[flag] = schema[bound]
            out[bound] = True

    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties:
            out["properties"] = {name: structural(p, defs) for name, p in properties.items()}
            # A nested object whose fields all have defaults gets a default, so the API server fills
            # it in and CEL rules can rely on its fields. The default is written out in full, not as
            # {}: the API server checks each default against the node's own CEL rules *without*
            # defaulting inside it, so `{}` fails any rule that reads a defaulted field.
            for name, prop in out["properties"].items():
                if (
                    prop.get("type") == "object"
                    and "properties" in prop
                    and not prop.get("required")
                    and not prop.get("nullable")
                ):
                    prop["default"] = filled_default(prop)
                    out["properties"][name] = _ordered(prop)
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["items"] = structural(schema["items"], defs)
    elif kind is None and "enum" not in out:
        raise ValueError(f"schema node without a type cannot be expressed in a CRD: {schema}")
    return _ordered(out)


def _int_or_string(schema: dict[str, Any], branches: list[dict[str, Any]]) -> dict[str, Any]:
    """`int | Literal[...]` (e.g. a number of steps or "auto"): an int-or-string node, whose bounds and allowed words
    a CEL rule checks, since such a node may carry no type of its own."""
    number = next(b for b in branches if b["type"] == "integer")
    word = next(b for b in branches if b["type"] == "string")
    words = [word["const"]] if "const" in word else list(word["enum"])
    checks = [f"self >= {number['minimum']}"] if "minimum" in number else ["true"]
    listed = ", ".join(f"'{w}'" for w in words)
    node: dict[str, Any] = {k: v for k, v in schema.items() if k == "description" or (k == "default" and v is not None)}
    node["x-kubernetes-int-or-string"] = True
    node["x-kubernetes-validations"] = [
        {
            "rule": f"type(self) == int ? {' && '.join(checks)} : self in [{listed}]",
            "message": f"must be a whole number{' from ' + str(number['minimum']) if 'minimum' in number else ''} "
            f"or one of {listed}",
        }
    ]
    if any(b.get("type") == "null" for b in schema["anyOf"]):
        node["nullable"] = True
    return _ordered(node)


def filled_default(node: dict[str, Any]) -> dict[str, Any]:
    """What the API server makes of `{}` at this object node: every property that has a default."""
    return {
        name: copy.deepcopy(prop["default"]) for name, prop in node.get("properties", {}).items() if "default" in prop
    }


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Description and type first, properties last: easier to read in the committed YAML."""
    first = [k for k in ("description", "type") if k in node]
    last = [k for k in ("properties", "items", "additionalProperties") if k in node]
    middle = sorted(k for k in node if k not in first and k not in last)
    return {k: node[k] for k in first + middle + last}


def _without_defaults(node: Any) -> Any:
    """Status is written by the operator and the trainer, never defaulted by the API server."""
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    spec = model_schema(api.TrainingRunSpec)
    status = _without_defaults(model_schema(api_status.TrainingRunStatus))
    name_rule = {
        "rule": f"size(self.metadata.name) <= {api_meta.MAX_RUN_NAME_LENGTH} && "
        f"self.metadata.name.matches('{api_meta.RUN_NAME_PATTERN}')",
        "message": f"metadata.name must be at most {api_meta.MAX_RUN_NAME_LENGTH} characters of lowercase "
        "letters, digits and '-', starting with a letter, so that pod and Service names of its "
        "attempts fit in 63 characters",
    }
    return {
        "type": "object",
        "description": "A PyTorch training run that checkpoints to object storage and survives pod "
        "failures and preemptions.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "trainingrun.dev/v1alpha1"},
            "kind": {"type": "string", "description": "TrainingRun"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [name_rule],
    }


def printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
        {
            "name": "Progress",
            "type": "number",
            "jsonPath": ".status.progress.percent",
            "description": "Percent of totalSteps done",
        },
        {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.total"},
        {
            "name": "Checkpoint",
            "type": "date",
            "jsonPath": ".status.lastGoodCheckpoint.time",
            "description": "Age of the last good checkpoint",
        },
        {
            "name": "ETA",
            "type": "string",
            "jsonPath": ".status.progress.estimatedCompletionTime",
            "description": "When the run reaches totalSteps at its current step rate",
            "priority": 1,
        },
        {
            "name": "MFU",
            "type": "number",
            "jsonPath": ".status.progress.mfu",
            "description": "Model FLOPs utilisation: model FLOP/s over every GPU's dense peak",
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "kubeflow"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


CRD_FILE_NAME = f"{api.PLURAL}.{api.GROUP}.yaml"
CRD_PATHS = (f"manifests/crds/{CRD_FILE_NAME}", f"charts/trainingrun-operator/crds/{CRD_FILE_NAME}")
HEADER = "# Generated from operator/trainingrun_operator/api.py by `trainingrun crd`; do not edit.\n"


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated sub-schemas out in full: kubectl users read this file, not anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Multi-line values (the mounted config file) read best as literal blocks.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_NoAliasDumper.add_representer(str, _represent_str)


def to_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_NoAliasDumper, sort_keys=False, width=100)


def crd_yaml() -> str:
    return HEADER + to_yaml(crd())
