"""Turn a TrainingRun document into a parsed model or a list of problems a person can act on.

Each problem names the field path as written in YAML (`spec.replicas.min`), says what is wrong and
how to fix it. Pydantic finds the problems; problems.py words them.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from typing import Any, Iterable, Optional

import yaml
from pydantic import ValidationError

from trainingrun_api.config import TrainerConfig

from . import api
from .problems import Problem, problems_from


class InvalidTrainingRun(Exception):
    """Raised with every problem of a document at once."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    def print_to_stderr(self, path: str) -> None:
        """One line per problem, each starting with the file's `path`: what the CLI's commands print."""
        for problem in self.problems:
            print(f"{path}: {problem}", file=sys.stderr)


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


#: What the API server and etcd take: a pod's annotations, where it carries its trainer config, are at most
#: kube_shapes.MAX_ANNOTATIONS_BYTES; etcd refuses a write over 1.5 MiB, and a run's job and the run itself are
#: kept under 1 MiB so they fit with room for status and managedFields.
MAX_OBJECT_BYTES = 1024 * 1024


def rendered_problems(document: dict[str, Any], run: api.TrainingRun) -> list[Problem]:
    """Problems that show only once the children are rendered: sizes the API server or etcd refuse."""
    import json

    from . import backends, builders, kube_shapes, naming
    from .settings import Settings

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
    annotations = builders.pod_template(run, 1, Settings(), None)["metadata"]["annotations"]
    size = kube_shapes.annotations_bytes(annotations)
    if size > kube_shapes.MAX_ANNOTATIONS_BYTES:
        config = len(annotations[naming.ANNOTATION_CONFIG].encode())
        problems.append(
            Problem(
                "spec.trainer",
                f"renders to a {config}-byte config, which its pods carry in an annotation: with "
                f"spec.podAnnotations that is {size} bytes of annotations, and a pod takes at most "
                f"{kube_shapes.MAX_ANNOTATIONS_BYTES}: move large initArgs into the image or storage",
            )
        )
    # Each backend the run may become (its spec.backend, else the operator's default, unknown here).
    for backend in [backends.BACKENDS[run.spec.backend]] if run.spec.backend else backends.BACKENDS.values():
        job = backend.children(run, 1)[-1]
        size = len(json.dumps(job, separators=(",", ":")))
        if size > MAX_OBJECT_BYTES:
            problems.append(
                Problem(
                    "spec.env",
                    f"the {backend.kind} would be {size} bytes; Kubernetes keeps objects under "
                    f"{MAX_OBJECT_BYTES} bytes: shorten env values (or mount a ConfigMap)",
                )
            )
            break
    return problems


def component_problems(trainer: TrainerConfig, import_classes: bool = False) -> list[Problem]:
    """The classes named in `classPath`, and every problem of their `initArgs`, checked as the trainer would at start:
    the trainer's own from builtin_args (no torch here); with `import_classes`, any other class that is importable
    here too (`trainingrun validate` on the user's machine; never the operator, which must not import what a spec
    names). The rest are checked when the run starts (`unchecked_classes` lists them)."""
    from trainingrun_api import components

    problems = []
    for component, field, extra in components.named_classes(trainer):
        try:
            if not components.check_builtin(component, field, **extra) and import_classes:
                if _importable(component.class_path):
                    components.check(component, field, **extra)
        except components.ConfigError as error:
            for line in str(error).splitlines():
                path, _, message = line.partition(": ")
                problems.append(Problem(path, message))
    return problems


def _importable(class_path: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(class_path.rpartition(".")[0]) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def unchecked_classes(trainer: TrainerConfig, import_classes: bool = False) -> list[tuple[str, str]]:
    """(field, classPath) of each named class whose initArgs `component_problems` could not check here."""
    from trainingrun_api import components

    return [
        (field, component.class_path)
        for component, field, _ in components.named_classes(trainer)
        if not components.is_builtin(component.class_path)
        and not (import_classes and _importable(component.class_path))
    ]


def _trainer_alone(document: Any) -> TrainerConfig | None:
    """spec.trainer parsed by itself, so its classes are checked in the same pass as the problems elsewhere in the
    document; None where it has problems of its own (those are already listed)."""
    spec = document.get("spec") if isinstance(document, dict) else None
    trainer = spec.get("trainer", {}) if isinstance(spec, dict) else None
    try:
        return TrainerConfig.from_wire(trainer)
    except ValidationError:
        return None


def credential_problems(trainer: TrainerConfig) -> list[Problem]:
    """Strings of spec.trainer (initArgs of models, datasets and callbacks included, which the CRD's schema cannot see
    into) that hold credentials in a URI (user:password@): they would sit in its pods' annotations and go to trackers.
    The problem names the field, never the value."""
    from trainingrun_api.model_base import CREDENTIALS_IN_URI, TRACKER_CREDENTIALS

    found: list[Problem] = []
    wire = trainer.to_wire()
    if "://" not in json.dumps(wire):  # no URI at all (most runs): no walk, which built a path for every field
        return found
    pending: list[tuple[str, Any]] = [("spec.trainer", wire)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending += [(f"{path}.{key}", item) for key, item in value.items()]
        elif isinstance(value, list):
            pending += [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        elif isinstance(value, str) and re.match(CREDENTIALS_IN_URI, value):
            found.append(Problem(path, TRACKER_CREDENTIALS.replace("a tracker's credentials", "credentials")))
    return sorted(found, key=lambda problem: problem.path)


def check(document: Any, builtin_classes: bool = True, import_classes: bool = False) -> api.TrainingRun:
    """`parse`, then the trainer's classes and the rendered children's limits: everything `trainingrun validate`
    checks, every problem in one pass. Without `builtin_classes`, what the API server can check too (it cannot know
    the trainer's classes); `import_classes`: see component_problems."""
    try:
        run = parse(document)
    except InvalidTrainingRun as error:
        trainer = _trainer_alone(document) if builtin_classes else None
        if trainer is not None:
            error.problems += component_problems(trainer, import_classes) + credential_problems(trainer)
        raise
    problems = []
    if builtin_classes:
        problems += component_problems(run.spec.trainer, import_classes) + credential_problems(run.spec.trainer)
    problems += rendered_problems(document, run)
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


class _RecursiveAlias(Exception):
    def __init__(self, node: yaml.Node):
        self.node = node


def _expanded_size(node: yaml.Node, memo: dict[int, Optional[int]]) -> int:
    """Nodes below `node` once aliases are expanded; _RecursiveAlias for a node that holds itself (`&a [*a]`), which
    PyYAML builds as a list inside itself, and every walk over the document would then recurse without end."""
    if id(node) in memo:
        size = memo[id(node)]
        if size is None:  # still being counted: this node is inside itself
            raise _RecursiveAlias(node)
        return size
    memo[id(node)] = None
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[id(node)] = size
    return size


def _load_all(stream: Any) -> Iterable[Any]:
    loader = _StrictLoader(stream)
    try:
        while loader.check_node():
            node = loader.get_node()
            assert node is not None  # check_node said one follows
            try:
                size = _expanded_size(node, {})
            except _RecursiveAlias as recursive:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "this value holds itself through an alias (*name inside the &name it names): write the values "
                    "out instead",
                    recursive.node.start_mark,
                ) from None
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


def load_runs(path: str, import_classes: bool = False) -> list[api.TrainingRun]:
    """Every TrainingRun in a file, or InvalidTrainingRun with the problems of all documents."""
    documents = load_file(path)
    runs, problems = [], []
    for index, document in enumerate(documents):
        try:
            runs.append(check(document, import_classes=import_classes))
        except InvalidTrainingRun as error:
            prefix = f"document {index + 1}: " if len(documents) > 1 else ""
            problems += [Problem(prefix + p.path, p.message) for p in error.problems]
    if problems:
        raise InvalidTrainingRun(problems)
    return runs
