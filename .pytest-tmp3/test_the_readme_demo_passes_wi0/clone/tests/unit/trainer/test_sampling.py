"""sampling.ResumableSampler: each sample once per epoch across ranks, resumed at any world size (hypothesis over
sequences of world sizes), with a DataLoader in the trainer's loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from trainingrun_trainer.data import SyntheticText
from trainingrun_trainer.sampling import ResumableSampler

# ---------------------------------------------------------------- sampler


def train(samplers, steps, collect):
    """What the trainer does: every rank takes its per-step share, then all advance by one global step.

    Iterators are made once and kept across steps (as a DataLoader's are); a new one is made only
    when one runs out, i.e. at an epoch boundary. Returns the epoch each step's samples came from.
    """
    iterators = [iter(s) for s in samplers]
    for _ in range(steps):
        epoch = samplers[0].epoch
        step = []
        for rank, sampler in enumerate(samplers):
            share = [next(iterators[rank], None) for _ in range(sampler.samples_per_step)]
            assert None not in share, "a rank ran out of indices in the middle of a step"
            step.extend(share)
        collect.append((epoch, step))
        for sampler in samplers:
            sampler.advance(sampler.global_step_samples)
        if samplers[0].consumed == 0:  # rolled over: the next epoch needs new iterators
            iterators = [iter(s) for s in samplers]
    states = {tuple(sorted(s.state_dict().items())) for s in samplers}
    assert len(states) == 1, "ranks disagree about the position"


def ranks(world_size, dataset_len, samples_per_step=1, seed=0, shuffle=True):
    return [
        ResumableSampler(dataset_len, rank, world_size, seed, shuffle, samples_per_step) for rank in range(world_size)
    ]


def test_two_ranks_cover_an_epoch_exactly_once():
    samplers = ranks(2, 100)
    seen = [list(s) for s in samplers]
    assert len(seen[0]) == len(seen[1]) == 50 == len(samplers[0])
    assert sorted(seen[0] + seen[1]) == list(range(100))


def test_each_step_takes_the_next_window_of_the_permutation():
    samplers = ranks(3, 50, samples_per_step=4)
    collected = []
    train(samplers, 4, collected)
    order = samplers[0].permutation(0)
    for k, (_, step) in enumerate(collected):
        assert sorted(step) == sorted(order[12 * k : 12 * (k + 1)])


@pytest.mark.parametrize(
    "before,after", [((2, 4), (1, 4)), ((1, 3), (2, 3)), ((2, 2), (3, 5)), ((4, 1), (2, 3))], ids=str
)
def test_resume_at_another_world_size_continues_exactly(before, after):
    """Stop after k steps at one world size, resume from the state at another: the rest of the epoch."""
    dataset_len = 103
    first = ranks(before[0], dataset_len, samples_per_step=before[1], seed=7)
    collected = []
    train(first, 5, collected)
    state = first[0].state_dict()
    assert state == {"epoch": 0, "consumed": 5 * before[0] * before[1]}

    second = ranks(after[0], dataset_len, samples_per_step=after[1], seed=7)
    for sampler in second:
        sampler.load_state_dict(state)
    remaining_steps = (dataset_len - state["consumed"]) // (after[0] * after[1])
    train(second, remaining_steps, collected)

    assert second[0].state_dict() == {"epoch": 1, "consumed": 0}
    taken = [i for _, step in collected for i in step]
    assert len(taken) == len(set(taken)), "a sample was repeated"
    order = first[0].permutation(0)
    assert sorted(taken) == sorted(order[: len(taken)]), "a sample was skipped"
    assert dataset_len - len(taken) < after[0] * after[1]  # only a ragged tail is dropped


@settings(max_examples=150, deadline=None)
@given(
    dataset_len=st.integers(1, 120),
    sizes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4),
    stops=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_sequence_of_world_sizes_sees_each_sample_once_per_epoch(dataset_len, sizes, stops, seed):
    """Attempts at changing (world size, samples per step), each stopped anywhere: per epoch, the
    samples trained on are the epoch's permutation in order, no repeats, no gaps but the tail."""
    sizes = [(w, b) for w, b in sizes if w * b <= dataset_len]
    if not sizes:
        return
    state = None
    collected = []
    for (world_size, samples_per_step), stop in zip(sizes, stops):
        samplers = ranks(world_size, dataset_len, samples_per_step, seed)
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
        train(samplers, stop, collected)
        state = samplers[0].state_dict()

    by_epoch = {}
    for epoch, step in collected:
        by_epoch.setdefault(epoch, []).append(step)
    reference = ResumableSampler(dataset_len, 0, 1, seed)
    for epoch, steps in by_epoch.items():
        order = reference.permutation(epoch)
        position = 0
        for step in steps:
            # Each step is the next window of the epoch's order: nothing skipped, nothing repeated.
            assert sorted(step) == sorted(order[position : position + len(step)])
            position += len(step)
        if epoch < state["epoch"]:  # a finished epoch left less than one step behind
            assert dataset_len - position < max(w * b for w, b in sizes)


def test_epoch_rolls_over_and_reshuffles():
    samplers = ranks(2, 10, samples_per_step=2)  # 4 per step: 2 steps, a tail of 2 dropped
    assert len(samplers[0]) == 4
    collected = []
    train(samplers, 2, collected)
    assert samplers[0].state_dict() == {"epoch": 1, "consumed": 0}
    train(samplers, 2, collected)
    assert samplers[0].state_dict() == {"epoch": 2, "consumed": 0}
    assert [epoch for epoch, _ in collected] == [0, 0, 1, 1]
    assert samplers[0].permutation(0) != samplers[0].permutation(1)
    first_epoch = collected[0][1] + collected[1][1]
    assert len(set(first_epoch)) == 8


def test_tail_smaller_than_a_step_at_the_new_world_size_ends_the_epoch():
    sampler = ResumableSampler(10, 0, 4, samples_per_step=1)
    sampler.load_state_dict({"epoch": 3, "consumed": 8})  # 2 left, a step needs 4
    assert sampler.state_dict() == {"epoch": 4, "consumed": 0}
    assert len(sampler) == 2


def test_determinism_across_instances_and_seeds():
    a, b = ResumableSampler(50, 1, 2, seed=3), ResumableSampler(50, 1, 2, seed=3)
    assert list(a) == list(b)
    assert list(a) != list(ResumableSampler(50, 1, 2, seed=4))
    # seed + epoch would collide here; the permutations must not.
    assert ResumableSampler(50, 0, 1, seed=1).permutation(0) != ResumableSampler(50, 0, 1, seed=0).permutation(1)


def test_no_shuffle_is_in_order():
    assert list(ResumableSampler(7, 1, 2, shuffle=False)) == [1, 3, 5]


def test_a_new_iterator_starts_at_the_saved_position():
    sampler = ResumableSampler(20, 1, 2, seed=0)
    everything = list(sampler)
    sampler.advance(6)
    assert list(sampler) == everything[3:]
    assert len(sampler) == 7


def test_set_epoch_keeps_a_resumed_position_and_moves_to_a_new_epoch():
    sampler = ResumableSampler(20, 0, 1)
    sampler.load_state_dict({"epoch": 2, "consumed": 5})
    sampler.set_epoch(2)
    assert sampler.state_dict() == {"epoch": 2, "consumed": 5}
    sampler.set_epoch(3)
    assert sampler.state_dict() == {"epoch": 3, "consumed": 0}


def test_advance_checks_its_argument():
    sampler = ResumableSampler(20, 0, 2, samples_per_step=3)
    expected = r"advance\(4\): must be a positive multiple of world_size x samples_per_step = 6"
    with pytest.raises(ValueError, match=expected):
        sampler.advance(4)
    with pytest.raises(ValueError, match=r"advance\(24\): only 18 samples are left in epoch 0"):
        sampler.advance(24)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dataset_len=10, rank=2, world_size=2), r"rank must be in \[0, world_size=2\), got 2"),
        (dict(dataset_len=10, rank=0, world_size=0), r"world_size must be a positive integer, got 0"),
        (
            dict(dataset_len=5, rank=0, world_size=2, samples_per_step=3),
            r"dataset_len \(5\) is smaller than one global step",
        ),
        (dict(dataset_len=5, rank=0, world_size=1, seed=-1), r"seed must be an integer in \[0, 2\*\*32\)"),
    ],
)
def test_sampler_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResumableSampler(**kwargs)


def test_load_state_that_does_not_fit_the_dataset():
    with pytest.raises(ValueError, match="does not fit a dataset of 10 samples; was the dataset changed"):
        ResumableSampler(10, 0, 1).load_state_dict({"epoch": 0, "consumed": 11})


def test_works_with_a_dataloader():
    dataset = SyntheticText(num_samples=24, context_length=4)
    sampler = ResumableSampler(len(dataset), 0, 1, seed=0, samples_per_step=4)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    assert batches[0]["tokens"].shape == (4, 5)


def loader_run(dataset_len, batch_size, accumulation, steps, samples_per_step, state=None):
    """The trainer's loop on one rank: endless DataLoader batches from the sampler's position,
    `accumulation` micro-batches per step, `advance` after each step. Returns per-step (epoch, indices)."""
    dataset = torch.utils.data.TensorDataset(torch.arange(dataset_len))
    sampler = ResumableSampler(dataset_len, 0, 1, seed=5, samples_per_step=samples_per_step)
    if state:
        sampler.load_state_dict(state)

    def batches():
        while True:
            for (batch,) in DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True):
                yield batch.tolist()

    stream, taken = batches(), []
    for _ in range(steps):
        epoch = sampler.epoch
        taken.append((epoch, [i for _ in range(accumulation) for i in next(stream)]))
        sampler.advance(batch_size * accumulation)
    return taken, sampler


@pytest.mark.parametrize("accumulation", [1, 3])
def test_trainer_loop_with_a_dataloader_sees_each_epoch_in_order(accumulation):
    batch_size = 4
    taken, sampler = loader_run(30, batch_size, accumulation, 10, samples_per_step=batch_size * accumulation)
    per_step = batch_size * accumulation
    steps_in_epoch = {}
    for epoch, indices in taken:
        k = steps_in_epoch.get(epoch, 0)
        assert indices == sampler.permutation(epoch)[k * per_step : (k + 1) * per_step]
        steps_in_epoch[epoch] = k + 1
    assert len(steps_in_epoch) > 1  # crossed at least one epoch boundary


def test_trainer_loop_without_samples_per_step_still_rolls_over():
    """Without accumulation, the default samples_per_step=1 works too: the last partial batch is
    dropped by the DataLoader and advance() ends the epoch when no further step fits."""
    taken, sampler = loader_run(10, 4, 1, 5, samples_per_step=1)
    assert [epoch for epoch, _ in taken] == [0, 0, 1, 1, 2]
    for epoch in (0, 1):
        assert [i for e, step in taken if e == epoch for i in step] == sampler.permutation(epoch)[:8]


def test_trainer_loop_resumes_from_a_saved_state():
    uninterrupted, _ = loader_run(30, 4, 2, 8, samples_per_step=8)
    first, stopped = loader_run(30, 4, 2, 5, samples_per_step=8)
    rest, _ = loader_run(30, 4, 2, 3, samples_per_step=8, state=stopped.state_dict())
    assert first + rest == uninterrupted
