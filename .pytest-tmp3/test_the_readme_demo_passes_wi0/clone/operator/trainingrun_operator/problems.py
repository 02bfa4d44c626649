"""A problem with a TrainingRun document, as a person can act on it: the field path as written in YAML
(`spec.replicas.min`), what is wrong and how to fix it, worded from pydantic's errors."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError

from . import api


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def problems_from(error: ValidationError) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    problems = []
    for item in error.errors(include_url=False):
        loc = [part for part in item["loc"] if not _is_internal(part)]
        problem = Problem(_path(loc), _message(dict(item), loc))
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            problems.append(problem)
    return problems


def _is_internal(part: Any) -> bool:
    # pydantic adds the tag of function validators and union branches to the location.
    return isinstance(part, str) and (part.startswith("function-") or part in {"literal[...]"} or "[" in part)


def _path(loc: list[Any]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string (quote it in YAML)",
    "dict_type": "a mapping (key: value lines)",
    "model_type": "a mapping (key: value lines)",
    "model_attributes_type": "a mapping (key: value lines)",
    "list_type": "a list (- item lines)",
}


def _message(item: dict[str, Any], loc: list[Any]) -> str:
    kind, ctx, value = item["type"], item.get("ctx") or {}, item.get("input")
    if loc[:2] == ["spec", "secrets"] and kind != "extra_forbidden":
        # Someone may have pasted a secret value where a reference goes: never echo it.
        value = "<value not shown>"
    if kind == "missing":
        return "is required but missing; add it"
    if kind == "extra_forbidden":
        return _unknown_field(loc)
    if kind in _TYPE_WORDS:
        return f"must be {_TYPE_WORDS[kind]}, got {_show(value)}; write it as {_TYPE_WORDS[kind]}"
    if kind == "finite_number":
        return f"must be a finite number, got {_show(value)}; write a number"
    if kind == "literal_error":
        allowed = [a.strip().strip("'\"") for a in str(ctx.get("expected", "")).replace(" or ", ",").split(",")]
        allowed = [a for a in allowed if a]
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else f"; use one of: {', '.join(allowed)}"
        return f"{_show(value)} is not allowed{hint}"
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        symbol, key = bounds[kind]
        limit = ctx.get(key)
        limit = f"{limit:g}" if isinstance(limit, float) else limit
        return f"must be {symbol} {limit}, got {_show(value)}; set a value {symbol} {limit}"
    if kind == "string_pattern_mismatch":
        if ctx.get("pattern") == api.QUANTITY:
            return (
                f"{_show(value)} is not a Kubernetes quantity; write a number with an optional unit, e.g. "
                "'900Gi', '512Mi', '8' or '7500m' (no space)"
            )
        return f"{_show(value)} does not have the expected form; make it match {ctx.get('pattern')}"
    if kind == "string_too_long":
        return f"is longer than {ctx.get('max_length')} characters; shorten it"
    if kind == "string_too_short":
        return f"is empty; give it a value (at least {ctx.get('min_length')} character)"
    if kind == "too_long":
        return f"has more than {ctx.get('max_length')} items; remove some"
    if kind == "too_short":
        return f"has fewer than {ctx.get('min_length')} items; add some"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", item["msg"]))
    return f"{item['msg']} (got {_show(value)})"


def _unknown_field(loc: list[Any]) -> str:
    known = _known_fields(api.TrainingRun, loc[:-1])
    name = str(loc[-1])
    if known is None:
        return "unknown field; remove it"
    # Users coming from LightningCLI write class_path; camelCase is what this API uses.
    camel = "".join(w.capitalize() if i else w for i, w in enumerate(name.split("_")))
    close = [camel] if camel in known else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean '{close[0]}'?"
    deeper = _nested_paths(api.TrainingRun, [str(p) for p in loc[:-1]], {name, camel})
    if deeper:
        return f"unknown field here; did you mean {' or '.join(deeper)}?"
    return f"unknown field; remove it (fields here: {', '.join(sorted(known))})"


def _nested_paths(model: type, parent: list[str], names: set[str], depth: int = 3) -> list[str]:
    """Where a field called one of `names` is, up to `depth` levels below `parent` (a field put one level too
    high, like spec.interval for spec.checkpoint.interval): the nearest first, at most three."""
    found: list[str] = []
    level = [parent]
    for _ in range(depth):
        below = []
        for path in level:
            for field in _known_fields(model, path) or []:
                if field in names and path != parent:
                    found.append(".".join([*path, field]))
                below.append([*path, field])
        if found:
            return found[:3]
        level = below
    return []


def _known_fields(model: type, loc: Iterable[Any]) -> Optional[list[str]]:
    """The wire names of the fields allowed at `loc` under `model`, if it is a model."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            args = typing.get_args(current)
            if not args:
                return None
            current = args[0]
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = next((f for n, f in current.model_fields.items() if (f.alias or n) == part or n == part), None)
        if field is None:
            return None
        current = field.annotation
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return None


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
