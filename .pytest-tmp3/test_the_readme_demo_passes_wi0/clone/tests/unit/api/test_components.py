"""`components.build` / `check`: the shipped classes build from camelCase config, and every mistake a
user can make in `classPath` / `initArgs` is a ConfigError naming the field and the fix."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainingrun_api import components
from trainingrun_api.components import ConfigError, build, camel_case, check, snake_case
from trainingrun_api.config import Component
from trainingrun_trainer import data, models, sampling, shards

MODEL = "spec.trainer.model"
DATASET = "spec.trainer.data.dataset"


def component(class_path, **init_args):
    return Component(class_path=class_path, init_args=init_args)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's module on sys.path, as a package installed in a derived trainer image would be."""
    (tmp_path / "user_models.py").write_text(
        textwrap.dedent(
            """
            CONSTRUCTED = []

            class Needy:
                def __init__(self, hidden_size, layers=1):
                    CONSTRUCTED.append(self)

            class TakesAnything:
                def __init__(self, **kwargs):
                    self.kwargs = kwargs

            class Picky:
                def __init__(self, size=1):
                    if size > 10:
                        raise ValueError(f"size must be at most 10, got {size}")

            class PositionalOnly:
                def __init__(self, x, /):
                    pass

            def factory(scale=2):
                return {"scale": scale}

            NOT_A_CLASS = 3
            """
        )
    )
    (tmp_path / "broken_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("user_models", "broken_module"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("contextLength", "context_length"),
        ("vocabSize", "vocab_size"),
        ("dim", "dim"),
        ("context_length", "context_length"),
        ("imageURL", "image_url"),
        ("decoderDim", "decoder_dim"),
    ],
)
def test_snake_case(name, expected):
    assert snake_case(name) == expected


def test_camel_case_round_trips_snake_case():
    for name in ("context_length", "vocab_size", "dim", "decoder_layers"):
        assert snake_case(camel_case(name)) == name


def test_builds_char_transformer_from_camel_case_init_args():
    spec = component("trainingrun_trainer.models.CharTransformer", dim=32, layers=1, contextLength=8, vocabSize=16)
    model = build(spec, MODEL)
    assert isinstance(model, models.CharTransformer)
    assert (model.dim, len(model.blocks), model.context_length, model.vocab_size) == (32, 1, 8, 16)


def test_builds_masked_autoencoder():
    spec = component(
        "trainingrun_trainer.models.MaskedAutoencoder", imageSize=16, patchSize=4, dim=32, decoderDim=32, maskRatio=0.5
    )
    model = build(spec, MODEL)
    assert isinstance(model, models.MaskedAutoencoder)
    assert model.num_patches == 16 and model.num_visible == 8


@pytest.mark.parametrize("split", ["train", "eval"])
def test_builds_datasets_with_the_trainers_split(split):
    text_spec = component("trainingrun_trainer.data.SyntheticText", numSamples=5, contextLength=8)
    image_spec = component("trainingrun_trainer.data.SyntheticImages", numSamples=3, imageSize=8)
    text = build(text_spec, DATASET, split=split)
    images = build(image_spec, DATASET, split=split)
    assert isinstance(text, data.SyntheticText) and text.split == split and len(text) == 5
    assert text[0]["tokens"].shape == (9,)
    assert isinstance(images, data.SyntheticImages) and images[0]["images"].shape == (3, 8, 8)


def test_default_components_of_the_config_build():
    from trainingrun_api.config import TrainerConfig

    config = TrainerConfig()
    assert isinstance(build(config.model, MODEL), models.CharTransformer)
    assert isinstance(build(config.data.dataset, DATASET, split="train"), data.SyntheticText)


def test_components_parsed_from_wire_yaml_build():
    wire = Component.from_wire(
        {
            "classPath": "trainingrun_trainer.models.CharTransformer",
            "initArgs": {"contextLength": 4, "dim": 16, "heads": 2},
        }
    )
    assert build(wire, MODEL).context_length == 4


def test_missing_module():
    with pytest.raises(ConfigError) as err:
        build(component("foo.bar.Model"), MODEL)
    assert str(err.value) == (
        "spec.trainer.model.classPath: cannot import module 'foo.bar' (No module named 'foo'); "
        "install the package in the trainer image or fix the path"
    )


def test_module_that_fails_while_importing(user_module):
    expected = r"^spec.trainer.model.classPath: importing module 'broken_module' failed: RuntimeError: boom at import$"
    with pytest.raises(ConfigError, match=expected):
        build(component("broken_module.Model"), MODEL)


def test_missing_class_suggests_the_closest():
    with pytest.raises(ConfigError) as err:
        build(component("trainingrun_trainer.models.CharTransfomer"), MODEL)
    assert str(err.value) == (
        "spec.trainer.model.classPath: module 'trainingrun_trainer.models' has no class 'CharTransfomer'; "
        "did you mean 'CharTransformer'?"
    )


def test_missing_class_without_a_close_match_lists_the_classes(user_module):
    expected = r"module 'user_models' has no class 'Zzz'; it has: Needy, Picky, PositionalOnly, TakesAnything$"
    with pytest.raises(ConfigError, match=expected):
        build(component("user_models.Zzz"), MODEL)


def test_not_a_class(user_module):
    expected = r"^spec.trainer.model.classPath: 'user_models.NOT_A_CLASS' is not a class \(it is of type int\)"
    with pytest.raises(ConfigError, match=expected):
        build(component("user_models.NOT_A_CLASS"), MODEL)


def test_a_factory_function_works(user_module):
    assert build(component("user_models.factory", scale=5), MODEL) == {"scale": 5}


def test_unexpected_argument_lists_accepted_and_suggests():
    with pytest.raises(ConfigError) as err:
        build(component("trainingrun_trainer.models.CharTransformer", dimm=8), MODEL)
    assert str(err.value) == (
        "spec.trainer.model.initArgs: CharTransformer() got an unexpected keyword argument 'dimm'; "
        "accepted: vocabSize, dim, layers, heads, contextLength, dropout; did you mean 'dim'?"
    )


def test_unexpected_argument_is_shown_as_written():
    expected = r"unexpected keyword argument 'contextLenght';.*did you mean 'contextLength'\?$"
    with pytest.raises(ConfigError, match=expected):
        build(component("trainingrun_trainer.models.CharTransformer", contextLenght=8), MODEL)


def test_missing_required_argument(user_module):
    with pytest.raises(ConfigError) as err:
        build(component("user_models.Needy", layers=2), MODEL)
    assert str(err.value) == (
        "spec.trainer.model.initArgs: Needy() is missing required argument 'hiddenSize'; add it to initArgs"
    )


def test_bad_arguments_never_construct(user_module):
    import user_models

    for bad in (component("user_models.Needy"), component("user_models.Needy", hiddenSize=1, extra=2)):
        with pytest.raises(ConfigError):
            build(bad, MODEL)
    assert user_models.CONSTRUCTED == []
    build(component("user_models.Needy", hiddenSize=1), MODEL)
    assert len(user_models.CONSTRUCTED) == 1


def test_same_argument_written_twice():
    with pytest.raises(ConfigError, match=r"'contextLength' and 'context_length' are the same argument; keep one"):
        build(component("trainingrun_trainer.models.CharTransformer", contextLength=8, context_length=8), MODEL)


def test_argument_the_trainer_sets_cannot_be_in_init_args():
    expected = r"^spec.trainer.data.dataset.initArgs: 'split' is set by the trainer for SyntheticText; remove it"
    with pytest.raises(ConfigError, match=expected):
        build(component("trainingrun_trainer.data.SyntheticText", split="eval"), DATASET, split="train")


def test_user_class_without_a_parameter_the_trainer_passes(user_module):
    expected = r"Needy\(\) does not accept 'split', which the trainer passes; add a 'split' parameter"
    with pytest.raises(ConfigError, match=expected):
        build(component("user_models.Needy", hiddenSize=1), DATASET, split="train")


def test_var_keyword_accepts_anything(user_module):
    built = build(component("user_models.TakesAnything", fooBar=1), MODEL, split="train")
    assert built.kwargs == {"foo_bar": 1, "split": "train"}


def test_positional_only_arguments_are_explained(user_module):
    with pytest.raises(ConfigError, match=r"positional-only argument\(s\) 'x', which a config cannot pass"):
        build(component("user_models.PositionalOnly"), MODEL)


def test_constructor_value_errors_name_init_args(user_module):
    with pytest.raises(ConfigError, match=r"^spec.trainer.model.initArgs: Picky\(\): size must be at most 10, got 11$"):
        build(component("user_models.Picky", size=11), MODEL)
    expected = r"^spec.trainer.model.initArgs: CharTransformer\(\): dim \(30\) must be divisible by heads \(4\)$"
    with pytest.raises(ConfigError, match=expected):
        build(component("trainingrun_trainer.models.CharTransformer", dim=30), MODEL)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_default_field_name():
    with pytest.raises(ConfigError, match=r"^component.classPath: cannot import module"):
        build(component("nosuchpackage.Thing"))


def test_check_imports_and_matches_arguments_without_constructing(user_module):
    import user_models

    assert check(component("user_models.Needy", hiddenSize=3), MODEL) is user_models.Needy
    assert user_models.CONSTRUCTED == []
    with pytest.raises(ConfigError, match="missing required argument 'hiddenSize'"):
        check(component("user_models.Needy"), MODEL)
    with pytest.raises(ConfigError, match="cannot import module 'foo'"):
        check(component("foo.Bar"), MODEL)
    with pytest.raises(ConfigError, match="does not accept 'split'"):
        check(component("user_models.Needy", hiddenSize=3), DATASET, split="train")


def test_check_does_not_build_the_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("check() constructed the model")

    monkeypatch.setattr(models.CharTransformer, "__init__", refuse)
    # The patched __init__ takes anything, so this tests only that check() never calls it.
    assert check(component("trainingrun_trainer.models.CharTransformer"), MODEL) is models.CharTransformer


def test_check_does_not_allocate_parameters():
    before = torch.random.get_rng_state()
    check(component("trainingrun_trainer.models.CharTransformer", dim=64), MODEL)
    # Construction would have drawn initial weights from the global RNG.
    assert torch.equal(torch.random.get_rng_state(), before)


def test_all_names_are_exported():
    for name in components.__all__:
        assert hasattr(components, name)


# ---------------------------------------------------------------- the table `validate` checks without torch


def test_the_table_of_builtin_classes_equals_the_code():
    import inspect

    found = {}
    for module in (models, data, sampling, shards):
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and (value.__module__ == module.__name__ or value.__module__.startswith(module.__name__ + "."))
                and not name.startswith("_")
                and not issubclass(value, Exception)
            ):
                found[f"{module.__name__}.{name}"] = {
                    p.name: p.default is p.empty for p in inspect.signature(value).parameters.values()
                }
    assert components.BUILTIN_CLASSES == found


def test_the_checked_arguments_have_the_codes_defaults():
    import inspect

    from trainingrun_api import builtin_args

    for path, spec in builtin_args.CLASSES.items():
        module, _, name = path.rpartition(".")
        signature = inspect.signature(getattr(sys.modules[module], name))
        defaults = {
            p.name: builtin_args.REQUIRED if p.default is p.empty else p.default for p in signature.parameters.values()
        }
        assert {arg: value.default for arg, value in spec.args.items()} == defaults, path


def _builtin_arguments():
    from trainingrun_api import builtin_args

    for path, spec in builtin_args.CLASSES.items():
        for name, arg in spec.args.items():
            if arg.accepts is not None and not arg.accepts({"not": "this"}):  # an argument that is a mapping
                yield pytest.param(path, name, id=f"{path.rpartition('.')[2]}.{name}")


@pytest.mark.parametrize("class_path, argument", list(_builtin_arguments()))
def test_each_builtin_constructor_refuses_what_validate_refuses(class_path, argument, tmp_path):
    """A value no argument takes (a mapping): the constructor refuses it in builtin_args' words, so validate, which
    checks the same table without torch, says what the trainer would."""
    from trainingrun_api import builtin_args

    spec = builtin_args.CLASSES[class_path]
    arguments = {
        name: next(
            v for v in (8, 0.0, True, str(tmp_path), "transformers.GPT2Config") if arg.accepts is None or arg.accepts(v)
        )
        for name, arg in spec.args.items()
        if arg.default is builtin_args.REQUIRED
    }
    arguments[argument] = {"not": "this"}
    module, _, name = class_path.rpartition(".")
    with pytest.raises(ValueError, match=rf"^{argument} must be .*, got \{{'not': 'this'\}}$"):
        getattr(sys.modules[module], name)(**arguments)
    assert builtin_args.problems(class_path, arguments) == [(argument, ANY_MESSAGE)]


class _AnyMessage(str):
    def __eq__(self, other):
        return isinstance(other, str) and other.startswith("must be ")

    __hash__ = str.__hash__


ANY_MESSAGE = _AnyMessage()


def test_every_problem_of_a_builtin_class_is_listed_at_once_naming_each_argument():
    comp = component("trainingrun_trainer.models.CharTransformer", dim=256, layers="x", contextLength=0, dimm=3)
    with pytest.raises(ConfigError) as caught:
        components.check_builtin(comp, MODEL)
    assert str(caught.value).splitlines() == [
        f"{MODEL}.initArgs: CharTransformer() got an unexpected keyword argument 'dimm'; accepted: vocabSize, dim, "
        "layers, heads, contextLength, dropout; did you mean 'dim'?",
        f"{MODEL}.initArgs.layers: must be a positive integer, got 'x'",
        f"{MODEL}.initArgs.contextLength: must be a positive integer, got 0",
    ]
    with pytest.raises(ConfigError) as imported:
        check(comp, MODEL)
    assert str(imported.value) == str(caught.value)
    relation = component("trainingrun_trainer.models.CharTransformer", dim=100, heads=3)
    with pytest.raises(
        ConfigError, match=r"initArgs: CharTransformer\(\): dim \(100\) must be divisible by heads \(3\)"
    ):
        components.check_builtin(relation, MODEL)


def test_a_user_class_is_checked_against_its_annotations(tmp_path, monkeypatch):
    (tmp_path / "annotated_models.py").write_text(
        textwrap.dedent(
            """
            from typing import Optional

            class Net:
                def __init__(self, layers: int = 2, name: str = "n", scale: Optional[float] = None,
                             sizes: tuple[int, ...] = (1,), anything=None):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        check(component("annotated_models.Net", layers=3, scale=2, sizes=[1, 2], anything="x"), MODEL)
        with pytest.raises(ConfigError) as caught:
            check(component("annotated_models.Net", layers="3", name=5, scale=True, sizes=["a"]), MODEL)
    finally:
        sys.modules.pop("annotated_models", None)
    assert str(caught.value).splitlines() == [
        f"{MODEL}.initArgs.layers: must be int, got '3'",
        f"{MODEL}.initArgs.name: must be str, got 5",
        f"{MODEL}.initArgs.scale: must be Optional[float], got True",
        f"{MODEL}.initArgs.sizes: must be tuple[int, ...], got ['a']",
    ]


@pytest.mark.parametrize(
    "class_path, init_args, field, extra",
    [
        ("trainingrun_trainer.models.CharTransfomer", {}, MODEL, {}),  # misspelt class
        ("trainingrun_trainer.modles.CharTransformer", {}, MODEL, {}),  # misspelt module
        ("trainingrun_trainer.models.CharTransformer", {"dimm": 64}, MODEL, {}),
        ("trainingrun_trainer.models.CharTransformer", {"contextLength": 8, "context_length": 8}, MODEL, {}),
        ("trainingrun_trainer.models.TransformerBlock", {"dim": 8}, MODEL, {}),  # a required argument missing
        ("trainingrun_trainer.data.SyntheticText", {"split": "eval"}, DATASET, {"split": "train"}),
        ("trainingrun_trainer.data.SyntheticText", {"numSamples": 8}, DATASET, {"split": "train"}),
    ],
)
def test_builtin_classes_are_checked_from_the_table_as_the_trainer_checks_them(class_path, init_args, field, extra):
    """Same verdict as importing the class; the messages name the field and the fix (the module's wording may
    differ only where importing a module that does not exist says so in Python's own words)."""
    comp = component(class_path, **init_args)
    try:
        check(comp, field, **extra)
        imported = None
    except ConfigError as error:
        imported = str(error)
    try:
        assert components.check_builtin(comp, field, **extra) is True
        table = None
    except ConfigError as error:
        table = str(error)
    assert (imported is None) == (table is None), (imported, table)
    if table is not None:
        assert table.startswith(field) and (table == imported or "no module" in table)


def test_classes_from_elsewhere_are_left_to_the_trainer(user_module):
    assert components.check_builtin(component("user_models.Needy", hiddenSize=3), MODEL) is False
    assert components.check_builtin(component("torchvision.models.ResNet"), MODEL) is False


@pytest.mark.parametrize(
    "trainer, field, extra",
    [
        ({"loggers": [{"kind": "wandb", "project": "p"}]}, "spec.trainer.loggers[0]: kind wandb", "wandb"),
        (
            {
                "data": {
                    "dataset": {"classPath": "trainingrun_trainer.shards.ImageShards", "initArgs": {"uri": "gs://b/x"}}
                }
            },
            "spec.trainer.data.dataset: trainingrun_trainer.shards.ImageShards",
            "images",
        ),
    ],
)
def test_an_optional_feature_whose_library_is_missing_names_the_field_and_the_extra(monkeypatch, trainer, field, extra):
    from trainingrun_api.components import OPTIONAL_LIBRARIES, check_libraries
    from trainingrun_api.config import TrainerConfig

    config = TrainerConfig.from_wire(trainer)
    check_libraries(config)  # all installed here
    module = OPTIONAL_LIBRARIES[field.split(": ")[1].removeprefix("kind ")][0]
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else found(name, *a))
    with pytest.raises(ConfigError) as error:
        check_libraries(config)
    assert str(error.value).startswith(f"{field} needs the {module} package")
    assert f"trainingrun-operator[trainer,{extra}]" in str(error.value)


def test_every_optional_library_is_an_extra_of_the_project():
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    from trainingrun_api.components import OPTIONAL_LIBRARIES

    for _module, extra in OPTIONAL_LIBRARIES.values():
        assert extra in extras, extra
