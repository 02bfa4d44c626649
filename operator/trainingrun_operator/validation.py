"""Turn a TrainingRun document into a parsed model or a list of problems a person can act on.

Each problem names the field path as written in YAML (`spec.replicas.min`), says what is wrong and
how to fix it. Pydantic finds the problems; this module only words them.
"""

from __future__ import annotations

import difflib
import functools
import re
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


class InvalidTrainingRun(Exception):
    """Raised with every problem of a document at once."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def parse(document: Any, from_server: bool = False) -> api.TrainingRun:
    """Parse one TrainingRun document or raise InvalidTrainingRun listing all its problems. `from_server`: the
    document was stored by the API server, which already pruned nulls and refused integers past int64."""
    if not isinstance(document, dict):
        raise InvalidTrainingRun(
            [
                Problem(
                    "",
                    f"expected a TrainingRun mapping, got {type(document).__name__}; "
                    "the file must be a YAML object with apiVersion, kind, metadata and spec",
                )
            ]
        )
    too_big = []
    if not from_server:
        document = without_pruned_nulls(document, _crd_schema())
        too_big = [
            Problem(path, f"{value} is outside the 64-bit integers Kubernetes stores; use a smaller number")
            for path, value in _huge_integers(document, "")
        ]
    try:
        run = api.TrainingRun.from_body(document)
    except ValidationError as error:
        raise InvalidTrainingRun(problems_from(error) + too_big) from None
    if too_big:
        raise InvalidTrainingRun(too_big)
    return run


INT64 = (-(2**63), 2**63 - 1)


def _huge_integers(value: Any, path: str) -> Iterable[tuple[str, int]]:
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _huge_integers(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _huge_integers(item, f"{path}[{index}]")


@functools.lru_cache(maxsize=1)
def _crd_schema() -> dict[str, Any]:
    from . import crd

    return crd.openapi_schema()


def without_pruned_nulls(value: Any, schema: dict[str, Any]) -> Any:
    """The document as the API server sees it before defaulting: a null in a field that is not nullable
    is dropped (so its default applies), as apiextensions' pruning of nulls does."""
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = properties.get(key) if properties else (extra if isinstance(extra, dict) else None)
            if item is None and sub is not None and not sub.get("nullable"):
                continue
            out[key] = without_pruned_nulls(item, sub) if sub is not None else item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [without_pruned_nulls(item, schema["items"]) for item in value]
    return value


#: What the API server and etcd take: a ConfigMap's data is at most 1 MiB (core/v1 validation), and
#: etcd refuses a write over 1.5 MiB; a run's PyTorchJob and the run itself are kept under 1 MiB so
#: they fit with room for status and managedFields.
MAX_CONFIG_MAP_BYTES = 1024 * 1024
MAX_OBJECT_BYTES = 1024 * 1024


def rendered_problems(document: dict[str, Any], run: api.TrainingRun) -> list[Problem]:
    """Problems that show only once the children are rendered: sizes the API server or etcd refuse."""
    import json

    from . import builders

    problems = []
    size = len(json.dumps(document, separators=(",", ":")))
    if size > MAX_OBJECT_BYTES:
        problems.append(
            Problem(
                "",
                f"the TrainingRun is {size} bytes; Kubernetes keeps objects under "
                f"{MAX_OBJECT_BYTES} bytes: move large values (initArgs, env) into the image "
                "or storage",
            )
        )
    config = builders.config_map(run)
    size = sum(len(v.encode()) for v in config["data"].values())  # the API server counts values only
    if size > MAX_CONFIG_MAP_BYTES:
        problems.append(
            Problem(
                "spec.trainer",
                f"renders to a {size}-byte config; a ConfigMap holds at most "
                f"{MAX_CONFIG_MAP_BYTES} bytes: move large initArgs into the image "
                "or storage",
            )
        )
    job = builders.pytorch_job(run, 1)
    size = len(json.dumps(job, separators=(",", ":")))
    if size > MAX_OBJECT_BYTES:
        problems.append(
            Problem(
                "spec.env",
                f"the PyTorchJob would be {size} bytes; Kubernetes keeps objects under "
                f"{MAX_OBJECT_BYTES} bytes: shorten env values (or mount a ConfigMap)",
            )
        )
    return problems


def component_problems(run: api.TrainingRun) -> list[Problem]:
    """The trainer's own classes named in `classPath`, and their `initArgs`, checked as the trainer would at start
    (from the table of its classes: no torch here). A class from the user's image is checked when the run starts."""
    from trainingrun_api import components

    problems = []
    for component, field, extra in components.named_classes(run.spec.trainer):
        try:
            components.check_builtin(component, field, **extra)
        except components.ConfigError as error:
            path, _, message = str(error).partition(": ")
            problems.append(Problem(path, message))
    return problems


def credential_problems(run: api.TrainingRun) -> list[Problem]:
    """Strings of spec.trainer (initArgs of models, datasets and callbacks included, which the CRD's schema cannot see
    into) that hold credentials in a URI (user:password@): they would sit in the run's ConfigMap and go to trackers.
    The problem names the field, never the value."""
    from trainingrun_api.model_base import CREDENTIALS_IN_URI, TRACKER_CREDENTIALS

    found = []
    pending: list[tuple[str, Any]] = [("spec.trainer", run.spec.trainer.to_wire())]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending += [(f"{path}.{key}", item) for key, item in value.items()]
        elif isinstance(value, list):
            pending += [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        elif isinstance(value, str) and re.match(CREDENTIALS_IN_URI, value):
            found.append(Problem(path, TRACKER_CREDENTIALS.replace("a tracker's credentials", "credentials")))
    return sorted(found, key=lambda problem: problem.path)


def check(document: Any, builtin_classes: bool = True) -> api.TrainingRun:
    """`parse`, then the trainer's classes and the rendered children's limits: everything `trainingrun validate`
    checks. Without `builtin_classes`, what the API server can check too (it cannot know the trainer's classes)."""
    run = parse(document)
    problems = (component_problems(run) + credential_problems(run) if builtin_classes else []) + rendered_problems(
        document, run
    )
    if problems:
        raise InvalidTrainingRun(problems)
    return run


#: How deep a document's mappings and sequences may nest: a TrainingRun nests about ten levels; the parser (and
#: everything that walks the result) recurses once per level, and a file nested 20,000 deep ended in a traceback.
MAX_DEPTH = 100


class _StrictLoader(yaml.SafeLoader):
    """Rejects a key given twice in one mapping (plain YAML silently keeps the last one), and nesting past MAX_DEPTH."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"the document nests deeper than {MAX_DEPTH} levels; flatten it",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)
# YAML 1.1 (PyYAML) reads 1e-8 as a string; Kubernetes reads YAML as 1.2 does, as a number, and `kubectl get -o
# yaml` writes floats that way. Resolve them as YAML 1.2's core schema does, so a file the cluster accepts validates.
_StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


#: Nodes a document may have once its YAML aliases are expanded; a "billion laughs" file of a few lines
#: expands to billions and would take every byte of memory when rendered.
MAX_EXPANDED_NODES = 100_000


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    if id(node) not in memo:
        memo[id(node)] = 1  # a recursive alias counts once instead of looping
        if isinstance(node, yaml.SequenceNode):
            memo[id(node)] = 1 + sum(_expanded_size(child, memo) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            memo[id(node)] = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    return memo[id(node)]


def _load_all(stream: Any) -> Iterable[Any]:
    loader = _StrictLoader(stream)
    try:
        while loader.check_node():
            node = loader.get_node()
            size = _expanded_size(node, {})
            if size > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the document expands to {size} nodes through its aliases (*name); at most "
                    f"{MAX_EXPANDED_NODES} are read: write the values out instead of repeating aliases",
                    node.start_mark,
                )
            yield loader.construct_document(node)
    finally:
        loader.dispose()


def load_file(path: str) -> list[Any]:
    """YAML documents of a file (empty ones dropped); raises InvalidTrainingRun for unreadable files."""
    try:
        with open(path, encoding="utf-8") as stream:
            documents = [d for d in _load_all(stream) if d is not None]
    except OSError as error:
        raise InvalidTrainingRun([Problem("", f"cannot read {path}: {error.strerror}")]) from None
    except UnicodeDecodeError:
        raise InvalidTrainingRun([Problem("", f"{path} is not UTF-8 text; save it as UTF-8 YAML")]) from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise InvalidTrainingRun(
            [Problem("", f"{path} is not valid YAML{at}: {getattr(error, 'problem', error)}")]
        ) from None
    if not documents:
        raise InvalidTrainingRun([Problem("", f"{path} holds no YAML document; write a TrainingRun in it")])
    return documents


def load_runs(path: str) -> list[api.TrainingRun]:
    """Every TrainingRun in a file, or InvalidTrainingRun with the problems of all documents."""
    documents = load_file(path)
    runs, problems = [], []
    for index, document in enumerate(documents):
        try:
            runs.append(check(document))
        except InvalidTrainingRun as error:
            prefix = f"document {index + 1}: " if len(documents) > 1 else ""
            problems += [Problem(prefix + p.path, p.message) for p in error.problems]
    if problems:
        raise InvalidTrainingRun(problems)
    return runs


# ---------------------------------------------------------------- wording


def problems_from(error: ValidationError) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    problems = []
    for item in error.errors(include_url=False):
        loc = [part for part in item["loc"] if not _is_internal(part)]
        problem = Problem(_path(loc), _message(item, loc))
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
