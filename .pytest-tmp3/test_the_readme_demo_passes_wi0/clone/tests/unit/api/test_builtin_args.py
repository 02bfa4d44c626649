"""builtin_args: the built-in classes' arguments checked without torch (`trainingrun validate` and the trainer's
constructors read the same table): each bad value named with what it must be, relations between arguments checked
only once each argument passed, and `require` raising every problem at once."""

from __future__ import annotations

import pytest

from trainingrun_api import builtin_args
from trainingrun_api.builtin_args import CLASSES, problems, require

TRANSFORMER = "trainingrun_trainer.models.CharTransformer"


def test_defaults_pass_for_every_class_that_has_them():
    for class_path, spec in CLASSES.items():
        if builtin_args.REQUIRED not in (arg.default for arg in spec.args.values()):
            assert problems(class_path, {}) == [], class_path


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"dim": 0}, [("dim", "must be a positive integer, got 0")]),
        ({"dim": True}, [("dim", "must be a positive integer, got True")]),  # a bool is no integer here
        ({"dropout": 1.0}, [("dropout", "must be a number in [0, 1), got 1.0")]),
        ({"dropout": float("nan")}, [("dropout", "must be a number in [0, 1), got nan")]),
        ({"vocab_size": 1}, [("vocab_size", "must be an integer of at least 2, got 1")]),
        ({"dim": 130, "heads": 4}, [("", "dim (130) must be divisible by heads (4)")]),
    ],
)
def test_each_bad_value_is_named_with_what_it_must_be(arguments, expected):
    assert problems(TRANSFORMER, arguments) == expected


def test_a_relation_is_checked_only_once_its_arguments_passed():
    assert problems(TRANSFORMER, {"dim": 130, "heads": 0}) == [("heads", "must be a positive integer, got 0")]


def test_unknown_names_are_left_to_the_signature_check():
    assert problems(TRANSFORMER, {"dimension": 3}) == []


def test_require_raises_every_problem_at_once():
    with pytest.raises(ValueError) as raised:
        require(TRANSFORMER, dim=0, dropout=2)
    assert str(raised.value) == ("dim must be a positive integer, got 0; dropout must be a number in [0, 1), got 2")
    require(TRANSFORMER, dim=256, heads=8)
