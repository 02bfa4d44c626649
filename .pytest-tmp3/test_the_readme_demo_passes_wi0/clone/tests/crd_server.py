"""Admit an object against a CRD offline, the way the Kubernetes API server would.

Why: the tests talk to kmock, which stores whatever it is given; it has no schema validation. A CRD
whose schema, defaults or CEL rules disagree with the pydantic models would pass every test and
fail only at `kubectl apply`. `admit(crd, obj)` runs an object through the parts of the API
server's create path that depend on the CRD, so tests can check the generated CRD itself.

Covered (mirroring k8s.io/apiextensions-apiserver):
- metadata.name present and a DNS-1123 subdomain;
- unknown fields, reported as kubectl's default strict field validation does (the API server stops
  there, so they block the CEL rules); they are not pruned from the returned object;
- pruning of nulls in fields that are not `nullable`, then structural defaulting (a missing
  property with a `default` gets a deep copy of it, then is defaulted itself, so `default: {}` fills
  in the nested defaults); `nullable` nulls are kept and not defaulted;
- OpenAPI v3.0 validation via jsonschema's Draft4Validator (`nullable` becomes a "null" type; as in
  kube-openapi, a null still fails an `enum` that does not list it);
- `x-kubernetes-list-type` map/set uniqueness;
- `x-kubernetes-validations` rules, evaluated with cel-python at every node present, with `self`
  shaped like the API server's CEL view: a null field of an object is absent to `has()`, `number`
  fields are doubles, the root sees only metadata.name/generateName. As in the API server, the rules
  are skipped when a type, enum, required or max-size error already exists.
Not covered: pruning (Warn/Ignore field validation), `format`, embedded resources,
int-or-string, update semantics (oldSelf/transition rules are skipped, no ratcheting),
messageExpression/reason/fieldPath, CEL type-checking at CRD creation (celpy only parses; a rule
naming a missing field makes `has()` false instead of failing), cost budgets, and the Kubernetes CEL
libraries (quantity(), url(), lists, format, ...), which celpy does not have.
Errors are "<path>: <message>", the path dotted with [i] for list items, "<root>" for the object.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any, Iterator

import celpy
from celpy import celtypes
from jsonschema import Draft4Validator

# Error kinds after which the API server does not evaluate CEL rules (strategy.go hasBlockingErr).
_BLOCKING = {"type", "enum", "required", "maxLength", "maxItems", "maxProperties"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def admit(crd: dict, obj: dict) -> tuple[dict, list[str]]:
    """Return (the object after API-server defaulting, the errors the API server would report)."""
    obj = copy.deepcopy(obj)
    spec = crd["spec"]
    versions = {f"{spec['group']}/{v['name']}": v for v in spec["versions"] if v.get("served", True)}
    if obj.get("apiVersion") not in versions or obj.get("kind") != spec["names"]["kind"]:
        return obj, [f"<root>: {obj.get('apiVersion')} {obj.get('kind')} is not served by this CRD"]
    schema = versions[obj["apiVersion"]]["schema"]["openAPIV3Schema"]
    _default(obj, schema)

    errors, blocked = [], False
    name = obj["metadata"].get("name") if isinstance(obj.get("metadata"), dict) else None
    if not isinstance(name, str) or not name:
        errors.append("metadata.name: Required value: name is required")
        blocked = True
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(f"metadata.name: {name!r} is not a lowercase RFC 1123 subdomain")
    for error in sorted(Draft4Validator(_jsonschema(schema)).iter_errors(obj), key=lambda e: e.json_path):
        path = list(error.absolute_path)
        if error.validator == "required":  # point at the missing field, as the API server does
            path.append(error.message.split("'")[1])
        errors.append(f"{_path(path)}: {error.message}")
        blocked |= error.validator in _BLOCKING
    for node, value, path in _nodes(schema, obj):
        shape = _shape(node, value, path)
        errors += shape
        blocked |= any(e.endswith(": unknown field") for e in shape)  # the API server stops there
    if blocked:
        errors.append("<root>: some validation rules were not checked because the object was invalid")
    else:
        errors += [e for node, value, path in _nodes(schema, obj) for e in _cel(node, value, path)]
    return obj, errors


def _sub(schema: dict, key: str) -> dict | None:
    """The schema of `key` in an object of `schema`, if it has one."""
    if "properties" in schema:
        return schema["properties"].get(key)
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _default(value: Any, schema: dict) -> None:
    """Prune non-nullable nulls, then apply defaults, in place (defaulting/algorithm.go)."""
    if isinstance(value, dict):
        for key in list(value):
            sub = _sub(schema, key)
            if value[key] is None and sub is not None and not sub.get("nullable"):
                del value[key]
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            if (sub := _sub(schema, key)) is not None:
                _default(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(item, schema["items"])


def _jsonschema(node: dict) -> dict:
    """An OpenAPI v3.0 structural schema as Draft 4 JSON Schema."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "nullable" or key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            value = {name: _jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            value = _jsonschema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            value = [_jsonschema(sub) for sub in value]
        out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _nodes(schema: dict, value: Any, path: tuple = ()) -> Iterator[tuple[dict, Any, tuple]]:
    """Every present (non-null) value with its schema and path, parents first."""
    if value is None:
        return
    yield schema, value, path
    if isinstance(value, dict):
        for key, item in value.items():
            if (sub := _sub(schema, key)) is not None:
                yield from _nodes(sub, item, path + (key,))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _nodes(schema["items"], item, path + (index,))


def _shape(schema: dict, value: Any, path: tuple) -> list[str]:
    """Unknown fields (kubectl's default fieldValidation=Strict rejects them) and duplicate items of
    x-kubernetes-list-type map/set lists."""
    if isinstance(value, dict) and "properties" in schema:
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        return [f"{_path(path + (k,))}: unknown field" for k in value if k not in schema["properties"]]
    kind, errors, seen = schema.get("x-kubernetes-list-type"), [], []
    for index, item in enumerate(value if kind in ("map", "set") and isinstance(value, list) else []):
        if kind == "map" and isinstance(item, dict):
            item = {k: item.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])}
        if item in seen:
            errors.append(f"{_path(path + (index,))}: Duplicate value: {item!r}")
        seen.append(item)
    return errors


def _cel(schema: dict, value: Any, path: tuple) -> list[str]:
    """Evaluate the node's x-kubernetes-validations rules with `self` bound to `value`."""
    errors, this = [], _cel_view(value, schema)
    if not path and isinstance(value.get("metadata"), dict):  # the root sees only these two
        this["metadata"] = {k: v for k, v in value["metadata"].items() if k in ("name", "generateName")}
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:  # transition rules only run on update
            continue
        try:
            result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(this)})
        except Exception as exc:  # noqa: BLE001 - parse and evaluation errors alike must show up
            errors.append(f"{_path(path)}: rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if not isinstance(result, celtypes.BoolType):
            errors.append(f"{_path(path)}: rule {rule['rule']!r} gave {result!r}, not a bool")
        elif not result:
            errors.append(f"{_path(path)}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
    return errors


def _cel_view(value: Any, schema: dict) -> Any:
    """The value as the API server's CEL sees it (apiserver/pkg/cel/common/values.go)."""
    if isinstance(value, dict):
        if "properties" in schema:  # nulls and unknown fields are absent
            props = schema["properties"]
            return {k: _cel_view(v, props[k]) for k, v in value.items() if k in props and v is not None}
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict):  # x-kubernetes-preserve-unknown-fields: an empty object
            return {}
        return {k: _cel_view(v, extra) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_view(v, schema.get("items", {})) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@functools.lru_cache(maxsize=None)
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _path(parts: list | tuple) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def default_errors(schema: dict, path: tuple = ()) -> list[str]:
    """Every `default` in a schema checked as the API server checks it when the CRD is created: against its
    own node's schema and CEL rules, with no defaulting inside it (so `default: {}` fails a rule that
    reads a field whose own default would only be filled in on objects)."""
    errors = []
    if "default" in schema:
        value = schema["default"]
        for error in Draft4Validator(_jsonschema(schema)).iter_errors(value):
            errors.append(f"{_path(path)}.default: {error.message}")
        for node, item, where in _nodes(schema, value, path):
            errors += [f"{e} (in the default of {_path(path)})" for e in _cel(node, item, where)]
    for key, sub in schema.get("properties", {}).items():
        errors += default_errors(sub, path + (key,))
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            errors += default_errors(schema[key], path + ("*",))
    return errors
