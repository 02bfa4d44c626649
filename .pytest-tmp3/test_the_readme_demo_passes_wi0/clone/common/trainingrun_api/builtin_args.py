"""The arguments of the trainer's built-in classes: names, defaults and checks, in a module that needs no torch.

Why: `trainingrun validate` and the operator must refuse `initArgs: {layers: "x"}` before a pod starts, and they
cannot import the trainer (it needs torch). So the checks live here once; the classes' constructors call
`require()` with their arguments, and validation calls `problems()` with the user's. A test keeps each table equal
to its class's signature (names and defaults).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Arg", "ClassArgs", "CLASSES", "REQUIRED", "problems", "require"]

#: The default of an argument a caller must give.
REQUIRED: Any = object()


@dataclass(frozen=True)
class Arg:
    """One constructor argument. `accepts` is None when the constructor checks it itself (the sampler's)."""

    default: Any = REQUIRED
    accepts: Optional[Callable[[Any], bool]] = None
    #: What `accepts` wants, as the message says it: "must be <expected>, got 'x'".
    expected: str = ""
    #: None is accepted too (the argument's "not set").
    optional: bool = False


@dataclass(frozen=True)
class ClassArgs:
    """A class's arguments in signature order, and the checks that relate two or more of them."""

    args: dict[str, Arg]
    #: (holds, message) over the arguments as a dict with defaults filled in; run only when each argument passed its
    #: own check. The message is formatted with the arguments (`{dim}`).
    relations: list[tuple[Callable[[dict[str, Any]], bool], str]] = field(default_factory=list)


def _integer(low: int, high: float = math.inf) -> Callable[[Any], bool]:
    return lambda value: type(value) is int and low <= value <= high


def _number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Callable[[Any], bool]:
    def accepts(value: Any) -> bool:
        if type(value) not in (int, float) or math.isnan(value):
            return False
        number = float(value)
        return (low < number if low_open else low <= number) and (number < high if high_open else number <= high)

    return accepts


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: type(value) is type(choices[0]) and value in choices


POSITIVE = Arg(accepts=_integer(1), expected="a positive integer")
SPLITS = ("train", "eval")
SPLIT = Arg("train", _one_of(*SPLITS), "one of 'train', 'eval'")
#: The token widths a shard may hold (shards/format.py reads them).
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
SEED = Arg(0, _integer(0, 2**32 - 1), "an integer in [0, 2**32)")
VOCAB = Arg(128, _integer(2), "an integer of at least 2")
DROPOUT = Arg(0.0, _number(0, 1, high_open=True), "a number in [0, 1)")
#: The last part of each shard held out as the eval split: 0 holds out nothing (evaluate on `spec.trainer.eval.
#: dataset` instead), 1 makes the whole of an eval dataset's files the eval split.
EVAL_FRACTION = Arg(0.05, _number(0, 1), "a number in [0, 1] (0: no held-out part, 1: all of it)")


def _positive(default: int) -> Arg:
    return Arg(default, POSITIVE.accepts, POSITIVE.expected)


#: Where a shard dataset's files are, and how they are read: the same for the three shard datasets.
URI = Arg(accepts=lambda v: isinstance(v, str) and bool(v), expected="a directory or file of shards, e.g. "
          "gs://bucket/tokens/")  # fmt: skip
READING = {
    "cache_dir": Arg(None, _text, "a directory", optional=True),
    "block_bytes": Arg(1 << 20, _integer(4096), "an integer of at least 4096"),
    "endpoint_url": Arg(None, _text, "a URL", optional=True),
    "read_ahead": Arg(512, _integer(0), "a whole number of items (0 turns it off)"),
    "fetch_threads": Arg(16, _integer(1), "a positive number of threads"),
}
NUM_SAMPLES = Arg(None, POSITIVE.accepts, POSITIVE.expected, optional=True)


def _pattern(default: str) -> Arg:
    return Arg(default, _text, "a glob of shard names")


_DIVISIBLE_HEADS = (lambda a: a["dim"] % a["heads"] == 0, "dim ({dim}) must be divisible by heads ({heads})")

CLASSES: dict[str, ClassArgs] = {
    "trainingrun_trainer.models.SelfAttention": ClassArgs(
        {
            "dim": POSITIVE,
            "heads": POSITIVE,
            "dropout": Arg(REQUIRED, DROPOUT.accepts, DROPOUT.expected),
            "causal": Arg(accepts=_one_of(True, False), expected="true or false"),
        },  # fmt: skip
        [_DIVISIBLE_HEADS],
    ),
    "trainingrun_trainer.models.TransformerBlock": ClassArgs(
        {
            "dim": POSITIVE,
            "heads": POSITIVE,
            "dropout": DROPOUT,
            "causal": Arg(False, _one_of(True, False), "true or false"),
        },  # fmt: skip
        [_DIVISIBLE_HEADS],
    ),
    "trainingrun_trainer.models.CharTransformer": ClassArgs(
        {
            "vocab_size": VOCAB,
            "dim": _positive(128),
            "layers": _positive(2),
            "heads": _positive(4),
            "context_length": _positive(64),
            "dropout": DROPOUT,
        },
        [_DIVISIBLE_HEADS],
    ),
    "trainingrun_trainer.models.MaskedAutoencoder": ClassArgs(
        {
            "image_size": _positive(32),
            "patch_size": _positive(4),
            "channels": _positive(3),
            "dim": _positive(128),
            "layers": _positive(2),
            "heads": _positive(4),
            "decoder_dim": _positive(64),
            "decoder_layers": _positive(1),
            "mask_ratio": Arg(
                0.75, _number(0, 1, low_open=True, high_open=True), "a number between 0 and 1 (exclusive)"
            ),  # fmt: skip
        },
        [
            (
                lambda a: a["image_size"] % a["patch_size"] == 0,
                "image_size ({image_size}) must be divisible by patch_size ({patch_size})",
            ),
            _DIVISIBLE_HEADS,
            (
                lambda a: a["decoder_dim"] % a["heads"] == 0,
                "decoder_dim ({decoder_dim}) must be divisible by heads ({heads})",
            ),
            (
                lambda a: a["image_size"] >= 2 * a["patch_size"],
                "image_size ({image_size}) must be at least 2 x patch_size ({patch_size}): masking needs 2+ patches",
            ),
        ],  # fmt: skip
    ),
    "trainingrun_trainer.models.HuggingFaceCausalLM": ClassArgs(
        {
            "config_class": Arg(
                accepts=lambda v: (
                    isinstance(v, str)
                    and re.fullmatch(r"(transformers\.)?[A-Za-z_][A-Za-z0-9_]*", v, re.ASCII) is not None
                ),
                expected="a configuration class of transformers, e.g. transformers.GPT2Config",
            ),
            "config": Arg(
                None, lambda v: isinstance(v, dict), "a mapping of the config class's arguments", optional=True
            ),
            "context_length": _positive(64),
        }
    ),
    "trainingrun_trainer.data.SyntheticText": ClassArgs(
        {
            "num_samples": _positive(10000),
            "context_length": _positive(64),
            "vocab_size": VOCAB,
            "seed": SEED,
            "split": SPLIT,
        }
    ),
    "trainingrun_trainer.data.SyntheticImages": ClassArgs(
        {
            "num_samples": _positive(10000),
            "image_size": _positive(32),
            "channels": _positive(3),
            "seed": SEED,
            "split": SPLIT,
        }
    ),
    "trainingrun_trainer.shards.TokenShards": ClassArgs(
        {
            "uri": URI,
            "context_length": _positive(64),
            "dtype": Arg("uint16", _one_of(*TOKEN_DTYPES), "one of " + ", ".join(TOKEN_DTYPES)),
            "pattern": _pattern("*.bin"),
            "vocab_size": Arg(None, VOCAB.accepts, VOCAB.expected, optional=True),
            "num_samples": NUM_SAMPLES,
            "eval_fraction": EVAL_FRACTION,
            "seed": SEED,
            "split": SPLIT,
            **READING,
        }
    ),
    "trainingrun_trainer.shards.TextBytes": ClassArgs(
        {
            "uri": URI,
            "context_length": _positive(64),
            "pattern": _pattern("*.txt"),
            "num_samples": NUM_SAMPLES,
            "eval_fraction": EVAL_FRACTION,
            "seed": SEED,
            "split": SPLIT,
            **READING,
        }
    ),
    "trainingrun_trainer.shards.ImageShards": ClassArgs(
        {
            "uri": URI,
            "image_size": _positive(32),
            "channels": Arg(3, _one_of(1, 3), "1 (grayscale) or 3 (RGB)"),
            "pattern": _pattern("*.tar"),
            "eval_fraction": EVAL_FRACTION,
            "split": SPLIT,
            **READING,
            "max_pixels": Arg(None, _integer(1), "an integer of at least image_size squared", optional=True),
        },
        [
            (
                lambda a: a["max_pixels"] is None or a["max_pixels"] >= a["image_size"] ** 2,
                "max_pixels must be an integer of at least image_size squared ({image_size}^2), got {max_pixels!r}",
            ),
        ],  # fmt: skip
    ),
    # Not named in a TrainingRun (the trainer makes it), so its constructor keeps its own checks.
    "trainingrun_trainer.sampling.ResumableSampler": ClassArgs(
        {
            "dataset_len": Arg(),
            "rank": Arg(),
            "world_size": Arg(),
            "seed": Arg(0),
            "shuffle": Arg(True),
            "samples_per_step": Arg(1),
        }
    ),
}


def problems(class_path: str, arguments: dict[str, Any]) -> list[tuple[str, str]]:
    """What is wrong with `arguments` (snake_case names, as the constructor takes them) for the built-in class, as
    (argument, message) pairs: one per argument, then ("", message) for each relation between arguments that each
    passed. Names and missing arguments are the signature's business (components.py), so an unknown name is skipped
    here and a missing one takes its default."""
    spec = CLASSES[class_path]
    found = []
    complete = {}
    for name, arg in spec.args.items():
        if name not in arguments:
            complete[name] = arg.default
            continue
        value = complete[name] = arguments[name]
        if arg.accepts is None or (value is None and arg.optional) or arg.accepts(value):
            continue
        found.append((name, f"must be {arg.expected}, got {value!r}"))
    if not found and REQUIRED not in complete.values():
        found += [("", message.format(**complete)) for holds, message in spec.relations if not holds(complete)]
    return found


def require(class_path: str, **arguments: Any) -> None:
    """What a built-in class's constructor calls first: a ValueError with every problem of its arguments."""
    found = problems(class_path, arguments)
    if found:
        raise ValueError("; ".join(f"{name} {message}" if name else message for name, message in found))
