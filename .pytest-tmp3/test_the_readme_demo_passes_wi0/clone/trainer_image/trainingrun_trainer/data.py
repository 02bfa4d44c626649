"""Generated datasets: what a run learns from when it names no data of its own.

Why generated data: the trainer must show a run learning (loss falling) on a laptop or in a test,
with no downloads and nothing to mount. Each item is a pure function of `(seed, split, index)`,
made with its own `numpy.random.default_rng([seed, tag, split, index])`, never a global RNG, so
any rank, DataLoader worker or later attempt gets the same item for the same index, whatever was
read before.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

from trainingrun_api import builtin_args

__all__ = ["SPLITS", "SyntheticText", "SyntheticImages", "checked_index", "split_id"]

SPLITS = builtin_args.SPLITS

# Each use of a seed gets its own nonzero tag in second place and a fixed number of words, so no
# two uses draw the same stream: numpy's SeedSequence ignores trailing zeros ([s, 0] == [s, 0, 0]).
_ITEM_TAG = 1  # [seed, tag, split, index]: one dataset item
_SHARED_TAG = 2  # [seed, tag]: what a dataset shares across splits (the text's "language")
ORDER_TAG = 3  # [seed, tag, epoch]: the sampler's permutation of an epoch


def split_id(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    return SPLITS.index(split)


def checked_index(index: int, length: int) -> int:
    """`index` as a position in [0, length), negative ones from the end, as a sequence takes them."""
    index = int(index)
    if index < 0:
        index += length
    if not 0 <= index < length:
        # IndexError (not ValueError) so plain iteration over the dataset stops here.
        raise IndexError(f"index {index} out of range for {length} samples")
    return index


class _SeededItems(Dataset):
    """Map-style dataset of `num_samples` items, item i built from its own seeded numpy Generator."""

    def __init__(self, num_samples: int, seed: int, split: str):
        self.num_samples = num_samples
        self.seed = seed
        self.split = split
        self._split_id = split_id(split)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = checked_index(index, self.num_samples)
        return self._make(np.random.default_rng([self.seed, _ITEM_TAG, self._split_id, index]))

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class SyntheticText(_SeededItems):
    """Character sequences from a fixed random Markov chain: `{"tokens": LongTensor[context_length + 1]}`.

    The chain is derived from `seed` alone, so both splits speak the same "language" and eval loss
    measures generalisation, not a different distribution. Each symbol has `BRANCHING` possible
    successors with random weights, so the best achievable loss (about 1 nat, `entropy_rate()`) is
    far below a uniform guess (ln vocab_size), and even a one-layer model gets there in a few
    hundred steps: a visible learning curve. Items start at a random symbol.
    """

    BRANCHING = 4

    def __init__(
        self,
        num_samples: int = 10000,
        context_length: int = 64,
        vocab_size: int = 128,
        seed: int = 0,
        split: str = "train",
    ):
        builtin_args.require(
            "trainingrun_trainer.data.SyntheticText", num_samples=num_samples, context_length=context_length,
            vocab_size=vocab_size, seed=seed, split=split,
        )  # fmt: skip
        super().__init__(num_samples, seed, split)
        self.context_length = context_length
        self.vocab_size = vocab_size
        rng = np.random.default_rng([seed, _SHARED_TAG])
        branching = min(self.BRANCHING, vocab_size)
        self.successors = np.stack([rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)])
        self.probabilities = rng.dirichlet(np.ones(branching), size=vocab_size)
        # Plain lists: the walk below is a python loop, and bisect on a list beats numpy per call.
        self._cumulative = np.cumsum(self.probabilities, axis=1).tolist()
        self._successor_lists = self.successors.tolist()

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        symbol = int(rng.integers(self.vocab_size))
        tokens = [symbol]
        last_choice = len(self._successor_lists[0]) - 1
        for draw in rng.random(self.context_length).tolist():
            # min() guards a draw above the last cumulative value after rounding.
            choice = min(bisect.bisect_right(self._cumulative[symbol], draw), last_choice)
            symbol = self._successor_lists[symbol][choice]
            tokens.append(symbol)
        return {"tokens": torch.tensor(tokens, dtype=torch.long)}

    def entropy_rate(self) -> float:
        """Mean next-symbol entropy in nats (uniform over states): roughly the best reachable loss."""
        p = self.probabilities
        return float(-(p * np.log(np.clip(p, 1e-12, None))).sum(axis=1).mean())


class SyntheticImages(_SeededItems):
    """Smooth colour images: `{"images": FloatTensor[channels, image_size, image_size]}`, in [-1, 1].

    Each image is a colour, plus a linear ramp in a random direction (with its own colour), plus
    `WAVES` faint plane waves (random orientation, 1-2 cycles per image, random phase). Hidden
    patches can be predicted from visible ones, which is what a masked autoencoder learns: a tiny
    one cuts its loss to about a quarter in a few hundred steps. Random oriented waves alone would
    be honest structure too, but too hard for a tiny model to show a learning curve quickly.
    Amplitudes are bounded (0.4 + 0.4 x 0.71 + 2 x 0.15 < 1), so no value leaves [-1, 1].
    """

    WAVES = 2

    def __init__(
        self,
        num_samples: int = 10000,
        image_size: int = 32,
        channels: int = 3,
        seed: int = 0,
        split: str = "train",
    ):
        builtin_args.require(
            "trainingrun_trainer.data.SyntheticImages", num_samples=num_samples, image_size=image_size,
            channels=channels, seed=seed, split=split,
        )  # fmt: skip
        super().__init__(num_samples, seed, split)
        self.image_size = image_size
        self.channels = channels
        # Centred coordinates, so a ramp through the middle stays within +-0.71 at the corners.
        coordinates = np.arange(image_size) / image_size - 0.5
        self._y, self._x = np.meshgrid(coordinates, coordinates, indexing="ij")

    def _along(self, angle: float) -> np.ndarray:
        return self._x * np.cos(angle) + self._y * np.sin(angle)

    def _colour(self, rng: np.random.Generator, amplitude: float) -> np.ndarray:
        return rng.uniform(-amplitude, amplitude, size=(self.channels, 1, 1))

    def _make(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        image = self._colour(rng, 0.4) + self._colour(rng, 0.4) * self._along(rng.uniform(0, 2 * np.pi))
        for _ in range(self.WAVES):
            angle, cycles, phase = rng.uniform(0, np.pi), rng.uniform(1, 2), rng.uniform(0, 2 * np.pi)
            image = image + self._colour(rng, 0.15) * np.sin(2 * np.pi * cycles * self._along(angle) + phase)
        return {"images": torch.from_numpy(image.astype(np.float32))}
