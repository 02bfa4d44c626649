"""Synthetic datasets (data.py) are pure functions of (seed, split, index), distinct per split and learnable. The
sampler: test_sampling.py; the loaders: test_loading.py."""

import random

import numpy as np
import pytest
import torch

from trainingrun_trainer.data import SyntheticImages, SyntheticText

# ---------------------------------------------------------------- datasets


def test_text_items_have_the_contract_shape():
    dataset = SyntheticText(num_samples=10, context_length=8, vocab_size=16)
    item = dataset[3]
    assert set(item) == {"tokens"}
    assert item["tokens"].shape == (9,) and item["tokens"].dtype == torch.long
    assert 0 <= item["tokens"].min() and item["tokens"].max() < 16
    assert len(dataset) == 10


def test_image_items_have_the_contract_shape_and_range():
    dataset = SyntheticImages(num_samples=50, image_size=12, channels=2)
    images = torch.stack([dataset[i]["images"] for i in range(len(dataset))])
    assert images.shape == (50, 2, 12, 12) and images.dtype == torch.float32
    assert images.abs().max() <= 1.0
    assert images.std() > 0.1  # not flat


@pytest.mark.parametrize("cls", [SyntheticText, SyntheticImages])
def test_items_are_a_pure_function_of_seed_split_and_index(cls):
    dataset = cls(num_samples=100)
    forward = [dataset[i] for i in (5, 6, 7)]
    np.random.seed(1), torch.manual_seed(1), random.seed(1)  # global RNGs must not matter
    again = cls(num_samples=100)
    backward = [again[i] for i in (7, 6, 5)][::-1]
    for a, b in zip(forward, backward):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cls", [SyntheticText, SyntheticImages])
def test_seed_split_and_index_each_change_the_item(cls):
    key = "tokens" if cls is SyntheticText else "images"
    base = cls(num_samples=10)[0][key]
    assert not torch.equal(base, cls(num_samples=10)[1][key])
    assert not torch.equal(base, cls(num_samples=10, seed=1)[0][key])
    assert not torch.equal(base, cls(num_samples=10, split="eval")[0][key])


def test_text_splits_share_the_language_but_not_the_items():
    train, held_out = SyntheticText(num_samples=200), SyntheticText(num_samples=200, split="eval")
    train_items = {tuple(train[i]["tokens"].tolist()) for i in range(len(train))}
    eval_items = {tuple(held_out[i]["tokens"].tolist()) for i in range(len(held_out))}
    assert not train_items & eval_items
    # Every transition in eval is one the chain allows, the same chain as in train.
    allowed = {(a, int(b)) for a in range(train.vocab_size) for b in train.successors[a]}
    for sequence in list(eval_items)[:20]:
        assert all(pair in allowed for pair in zip(sequence, sequence[1:]))


def test_text_is_learnable():
    dataset = SyntheticText(vocab_size=128)
    assert dataset.entropy_rate() < 0.5 * np.log(128)


@pytest.mark.parametrize("cls", [SyntheticText, SyntheticImages])
def test_bad_arguments(cls):
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'eval', got 'test'"):
        cls(split="test")
    with pytest.raises(ValueError, match=r"num_samples must be a positive integer, got 0"):
        cls(num_samples=0)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\), got -1"):
        cls(seed=-1)


def test_index_out_of_range():
    dataset = SyntheticText(num_samples=3, context_length=4)
    assert torch.equal(dataset[-1]["tokens"], dataset[2]["tokens"])
    with pytest.raises(IndexError, match="index 3 out of range for 3 samples"):
        dataset[3]


def test_numpy_integer_indices_work():
    dataset = SyntheticText(num_samples=3, context_length=4)
    assert torch.equal(dataset[np.int64(1)]["tokens"], dataset[1]["tokens"])
