"""Build the model and datasets named in the trainer config (`classPath` + `initArgs`).

Why this module exists: a TrainingRun names its model and dataset as text, and the first place the
text meets Python is a pod that is already part of a multi-node job. A typo found there costs a
rendezvous, an image pull and a restart per rank, and a bare `TypeError` traceback from deep inside
the trainer does not say which field of the TrainingRun to fix. So every failure here is a
`ConfigError` whose message starts with the field path (`spec.trainer.model.initArgs: ...`), says
what is wrong and how to fix it, and `check()` finds all of it without constructing anything, so
the trainer can call it before it creates a process group or allocates memory.

Names in `initArgs` arrive camelCase from YAML, like every other field of the API
(`contextLength`); Python constructors take snake_case (`context_length`). `build()` converts each
key with `snake_case()` before calling, so `contextLength` and `context_length` mean the same
argument (giving both is an error). Messages show argument names camelCase, as the user writes them.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import re
from typing import Any, Callable, Iterable, cast

from trainingrun_api import builtin_args
from trainingrun_api.config import Component, TrainerConfig
from trainingrun_api.model_base import ConfigError

__all__ = [
    "ConfigError",
    "BUILTIN_CLASSES",
    "OPTIONAL_LIBRARIES",
    "build",
    "check",
    "check_builtin",
    "check_libraries",
    "evaluated_dataset",
    "is_builtin",
    "named_classes",
    "resolve",
    "snake_case",
    "camel_case",
]

#: The public classes of the trainer's own modules and their constructor parameters (name: required), so a
#: TrainingRun that names one is checked without importing torch (`trainingrun validate`, the operator's image).
#: Made from builtin_args, where their checks are; tests/unit/api/test_components.py keeps it equal to the code.
BUILTIN_CLASSES: dict[str, dict[str, bool]] = {
    path: {name: arg.default is builtin_args.REQUIRED for name, arg in spec.args.items()}
    for path, spec in builtin_args.CLASSES.items()
}
BUILTIN_PACKAGE = "trainingrun_trainer"


_WORD_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(name: str) -> str:
    """`contextLength` -> `context_length`, `imageURL` -> `image_url`; snake_case stays as it is."""
    return _WORD_BOUNDARY.sub("_", name).lower()


def camel_case(name: str) -> str:
    """`context_length` -> `contextLength`: how a Python argument name is written in YAML."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def resolve(class_path: str, field: str = "component") -> Callable[..., Any]:
    """Import `package.module.ClassName` and return the class; errors name `<field>.classPath`."""
    where = f"{field}.classPath"
    module_name, _, class_name = class_path.rpartition(".")
    if not module_name or not class_name:
        raise ConfigError(f"{where}: '{class_path}' is not a dotted path; write it as package.module.ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{where}: cannot import module '{module_name}' ({err}); "
            "install the package in the trainer image or fix the path"
        ) from err
    except Exception as err:  # the module was found, but running it failed: show the user's error
        raise ConfigError(f"{where}: importing module '{module_name}' failed: {type(err).__name__}: {err}") from err

    if not hasattr(module, class_name):
        classes = _public_classes(module)
        close = difflib.get_close_matches(class_name, classes, n=1)
        if close:
            hint = f"did you mean '{close[0]}'?"
        elif classes:
            hint = f"it has: {', '.join(classes)}"
        else:
            hint = "it defines no public classes"
        raise ConfigError(f"{where}: module '{module_name}' has no class '{class_name}'; {hint}")

    target = getattr(module, class_name)
    # A factory function works as well as a class, so allow any callable, but nothing else.
    if not callable(target):
        raise ConfigError(
            f"{where}: '{class_path}' is not a class (it is of type {type(target).__name__}); name a class to construct"
        )
    return cast(Callable[..., Any], target)


def named_classes(trainer: TrainerConfig) -> list[tuple[Component, str, dict[str, Any]]]:
    """The classes a trainer config names: each with its field path and the arguments the trainer adds."""
    named = [
        (trainer.model, "spec.trainer.model", {}),
        (trainer.data.dataset, "spec.trainer.data.dataset", {"split": "train"}),
    ]
    if trainer.eval.dataset is not None:
        named.append(evaluated_dataset(trainer))
    return named


def evaluated_dataset(trainer: TrainerConfig) -> tuple[Component, str, dict[str, Any]]:
    """What evaluation reads, as named_classes' entries: `eval.dataset` where it is set, else the training dataset's
    held-out split. An eval.dataset of the built-in shard datasets comes with evalFraction 1 unless it sets one:
    all of its files are the eval split."""
    evaluated = trainer.eval.dataset
    if evaluated is None:
        return trainer.data.dataset, "spec.trainer.data.dataset", {"split": "eval"}
    holds_out = "eval_fraction" in BUILTIN_CLASSES.get(evaluated.class_path, {})
    if holds_out and not any(snake_case(key) == "eval_fraction" for key in evaluated.init_args):
        evaluated = evaluated.model_copy(update={"init_args": {**evaluated.init_args, "evalFraction": 1.0}})
    return evaluated, "spec.trainer.eval.dataset", {"split": "eval"}


#: What an optional feature (a logger kind, a built-in class) imports, and the pip extra of trainingrun-operator that
#: installs it. The stock trainer image installs every extra; an image built on `trainingrun-operator[trainer]` alone
#: has none of them.
OPTIONAL_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "trainingrun_trainer.shards.ImageShards": ("PIL", "images"),
    "trainingrun_trainer.models.HuggingFaceCausalLM": ("transformers", "huggingface"),
}
#: The extras Dockerfile.trainer installs.
STOCK_IMAGE_EXTRAS = ("tensorboard", "mlflow", "wandb", "images")


def check_libraries(trainer: TrainerConfig) -> None:
    """Raise ConfigError, naming the field and the extra to install, for each logger or built-in class of `trainer`
    whose library this Python lacks. Looked up without importing it, before the trainer starts anything."""
    needs: list[tuple[str, str, str]] = [
        (f"spec.trainer.loggers[{i}]", f"kind {logger.kind}", logger.kind) for i, logger in enumerate(trainer.loggers)
    ]
    needs += [(field, component.class_path, component.class_path) for component, field, _ in named_classes(trainer)]
    problems = []
    for field, what, key in needs:
        if key in OPTIONAL_LIBRARIES:
            module, extra = OPTIONAL_LIBRARIES[key]
            if importlib.util.find_spec(module) is None:
                problems.append(
                    f"{field}: {what} needs the {module} package, which this trainer image lacks; build "
                    f"the image with pip install 'trainingrun-operator[trainer,{extra}]' ("
                    + (
                        "the stock image has it)"
                        if extra in STOCK_IMAGE_EXTRAS
                        else "FROM the stock image, which lacks it)"
                    )
                )
    if problems:
        raise ConfigError("\n".join(problems))


def check(component: Component, field: str = "component", **extra_kwargs: Any) -> Callable[..., Any]:
    """Everything `build()` checks, without constructing: import, then match arguments to the signature, their
    types to its annotations (a built-in class's to its checks in builtin_args). Every problem of the arguments is
    in one ConfigError, a line each.

    `extra_kwargs` are the arguments the trainer itself adds (e.g. `split` for datasets); only their
    names matter here. Returns the class.
    """
    target, _, problems = _prepare(component, field, extra_kwargs)
    if problems:
        raise ConfigError("\n".join(problems))
    return target


@functools.cache
def _builtin_modules() -> dict[str, dict[str, inspect.Signature]]:
    """BUILTIN_CLASSES as {module: {class: its constructor's signature}}, made once: the operator checks every new
    run's components, and making the signatures each time was most of that."""
    modules: dict[str, dict[str, inspect.Signature]] = {}
    for path, params in BUILTIN_CLASSES.items():
        module_name, _, class_name = path.rpartition(".")
        modules.setdefault(module_name, {})[class_name] = inspect.Signature(
            [
                inspect.Parameter(
                    name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty if required else None
                )
                for name, required in params.items()
            ]
        )
    return modules


def is_builtin(class_path: str) -> bool:
    """Whether `class_path` names something in the trainer's own package (checkable from `BUILTIN_CLASSES`)."""
    return class_path.startswith(BUILTIN_PACKAGE + ".")


def check_builtin(component: Component, field: str = "component", **extra_kwargs: Any) -> bool:
    """`check()` for a class of the trainer's own package, from builtin_args instead of importing it (no torch
    needed). Returns False, having checked nothing, for a class from anywhere else: only the trainer's image (or
    `check()` where the class is installed) can check those."""
    if not is_builtin(component.class_path):
        return False
    module_name, _, class_name = component.class_path.rpartition(".")
    where = f"{field}.classPath"
    classes = _builtin_modules().get(module_name)
    if not classes:
        modules = sorted(_builtin_modules())
        raise ConfigError(
            f"{where}: the trainer has no module '{module_name}'; its classes are in {', '.join(modules)}"
        )
    if class_name not in classes:
        close = difflib.get_close_matches(class_name, list(classes), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"it has: {', '.join(sorted(classes))}"
        raise ConfigError(f"{where}: module '{module_name}' has no class '{class_name}'; {hint}")
    where = f"{field}.initArgs"
    kwargs, written_as = _keyword_arguments(component, where, extra_kwargs, class_name)
    problems = _signature_problems(classes[class_name], class_name, kwargs, written_as, where)
    problems += _value_problems(component.class_path, None, kwargs, written_as, where)
    if problems:
        raise ConfigError("\n".join(problems))
    return True


def build(component: Component, field: str = "component", **extra_kwargs: Any) -> Any:
    """Construct `component.class_path(**snake_cased(init_args), **extra_kwargs)`.

    `field` is the component's path in the config (`spec.trainer.model`); messages name
    `<field>.classPath` or `<field>.initArgs`. `extra_kwargs` are added by the trainer and may not
    also appear in `initArgs` (that would silently drop what the user wrote). A ValueError or
    TypeError raised by the constructor itself (e.g. `dim must be divisible by heads`) is re-raised
    as a ConfigError naming `<field>.initArgs`.
    """
    target, kwargs, problems = _prepare(component, field, extra_kwargs)
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return target(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{field}.initArgs: {_display_name(target)}(): {err}") from err


def _prepare(
    component: Component, field: str, extra_kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], dict[str, Any], list[str]]:
    """Import the class and build its keyword arguments; and every problem of them against its signature."""
    target = resolve(component.class_path, field)
    where = f"{field}.initArgs"
    kwargs, written_as = _keyword_arguments(component, where, extra_kwargs, _display_name(target))
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return target, kwargs, []  # some builtins have no signature; the constructor will complain itself
    problems = _signature_problems(signature, _display_name(target), kwargs, written_as, where)
    return target, kwargs, problems + _value_problems(component.class_path, target, kwargs, written_as, where)


def _value_problems(
    class_path: str,
    target: Callable[..., Any] | None,
    kwargs: dict[str, Any],
    written_as: dict[str, str],
    where: str,
) -> list[str]:
    """Arguments of the wrong type or out of bounds, each named as the user wrote it: a built-in class's from its
    checks in builtin_args, anyone else's from the annotations of its signature (where it has them)."""
    if class_path in builtin_args.CLASSES:
        found = builtin_args.problems(class_path, kwargs)
    elif target is not None:
        found = _annotation_problems(target, kwargs)
    else:
        return []
    name = class_path.rpartition(".")[2]
    return [
        f"{where}.{written_as.get(argument, argument)}: {message}" if argument else f"{where}: {name}(): {message}"
        for argument, message in found
    ]


def _annotation_problems(target: Callable[..., Any], kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """Values that do not fit their parameter's annotation (`layers: int` given "x"). YAML gives typed scalars, so
    a number in quotes is refused rather than converted; a list may fill a tuple or sequence. An annotation that
    cannot be resolved or checked (a forward reference, a tensor type) is skipped: the constructor checks it."""
    import typing

    from pydantic import TypeAdapter, ValidationError

    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # the user's module: unresolvable names, anything
        return []
    found = []
    for name, value in kwargs.items():
        hint = hints.get(name)
        if hint is None or hint is Any:
            continue
        try:
            adapter = TypeAdapter(hint)
        except Exception:  # a type pydantic cannot check (arbitrary classes)
            continue
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            try:
                if not isinstance(value, list):
                    raise
                adapter.validate_python(value)
            except ValidationError:
                found.append((name, f"must be {_type_name(hint)}, got {value!r}"))
            except Exception:  # noqa: BLE001 - as below
                continue
        except Exception:  # noqa: BLE001 - a type pydantic builds only when used (a config class whose annotations
            continue  # name what its module never defines: PydanticUserError): the constructor checks it
    return found


def _type_name(hint: Any) -> str:
    import typing

    plain = typing.get_origin(hint) is None and getattr(hint, "__name__", None)
    return plain or str(hint).replace("typing.", "")


def _keyword_arguments(
    component: Component, where: str, extra_kwargs: dict[str, Any], name: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """initArgs snake_cased, plus the trainer's own arguments; and how the user wrote each key."""
    kwargs: dict[str, Any] = {}
    written_as: dict[str, str] = {}  # snake_case name -> the key as the user wrote it, for messages
    for key, value in component.init_args.items():
        snake = snake_case(key)
        if snake in written_as:
            raise ConfigError(f"{where}: '{written_as[snake]}' and '{key}' are the same argument; keep one of them")
        written_as[snake] = key
        kwargs[snake] = value
    for key, value in extra_kwargs.items():
        if key in kwargs:
            raise ConfigError(f"{where}: '{written_as[key]}' is set by the trainer for {name}; remove it from initArgs")
        kwargs[key] = value
    return kwargs, written_as


def _signature_problems(
    signature: inspect.Signature, name: str, kwargs: dict[str, Any], written_as: dict[str, str], where: str
) -> list[str]:
    """Every mismatch between the arguments and the signature, found before construction, so a bad argument never
    leaves a half-built object behind."""
    params = signature.parameters.values()
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = [p.name for p in by_keyword]
    problems = []
    if not accepts_any:
        shown = [camel_case(a) for a in accepted]
        accepted_text = ", ".join(shown) if shown else "no arguments"
        for key in kwargs:
            if key in accepted:
                continue
            if key not in written_as:
                problems.append(
                    f"{where}: {name}() does not accept '{key}', which the trainer passes; "
                    f"add a '{key}' parameter to it (accepted: {accepted_text})"
                )
                continue
            close = difflib.get_close_matches(written_as[key], shown, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(
                f"{where}: {name}() got an unexpected keyword argument '{written_as[key]}'; "
                f"accepted: {accepted_text}{hint}"
            )

    missing = [p.name for p in by_keyword if p.default is p.empty and p.name not in kwargs]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        problems.append(
            f"{where}: {name}() is missing required argument{plural} "
            f"{_quoted(camel_case(m) for m in missing)}; add {'them' if plural else 'it'} to initArgs"
        )
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        problems.append(
            f"{where}: {name}() needs positional-only argument(s) {_quoted(positional_only)}, "
            "which a config cannot pass; give them defaults or make them keyword arguments"
        )
    return problems


def _public_classes(module: Any) -> list[str]:
    return sorted(n for n, v in vars(module).items() if not n.startswith("_") and inspect.isclass(v))


def _display_name(target: Callable[..., Any]) -> str:
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)
