"""shards.tokens.TokenShards: windows of tokens read by byte ranges through fsspec and a block cache (file:// here; the
storage servers in tests/integration/test_trainer_shards.py), and the eval datasets of their own."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader

from trainingrun_trainer.background import helper_niceness
from trainingrun_trainer.sampling import ResumableSampler
from trainingrun_trainer.shards import LLMC_HEADER_BYTES, DataError, TokenShards


def write_shard(path, tokens, dtype="uint16", llmc=False):
    tokens = np.asarray(tokens, dtype=dtype)
    with open(path, "wb") as out:
        if llmc:
            header = np.zeros(256, dtype="<i4")
            header[:3] = (20240520 if dtype == "uint16" else 20240801, 1, len(tokens))
            out.write(header.tobytes())
        out.write(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())


@pytest.fixture
def shards(tmp_path):
    """Two nanoGPT shards whose tokens count up (mod 60,000) from 0 and from 30,000: each window is a run of
    consecutive numbers, and its first token says where it came from."""
    directory = tmp_path / "tokens"
    directory.mkdir()
    write_shard(directory / "a.bin", np.arange(0, 5000) % 60000)
    write_shard(directory / "b.bin", np.arange(30000, 33000) % 60000)
    return directory


def dataset(directory, tmp_path, **kwargs):
    return TokenShards(f"file://{directory}", cache_dir=str(tmp_path / "cache"), block_bytes=4096, **kwargs)


def test_windows_are_consecutive_tokens_of_one_shard_chosen_by_seed_and_index(shards, tmp_path):
    data = dataset(shards, tmp_path, context_length=16)
    assert [s.tokens for s in data.shards] == [5000, 3000] and data.shards[0].uri.endswith("/tokens/a.bin")
    assert len(data) == (4750 + 2850) // 17  # about one pass over the train split by default
    seen_shards = set()
    for index in range(200):
        tokens = data[index]["tokens"]
        assert tokens.dtype == torch.long and tokens.shape == (17,)
        assert torch.equal(tokens, torch.arange(int(tokens[0]), int(tokens[0]) + 17))  # one shard, in order
        seen_shards.add("a" if tokens[0] < 30000 else "b")
        assert int(tokens[-1]) < 4750 or 30000 <= int(tokens[-1]) < 32850  # never the eval split's tail
    assert seen_shards == {"a", "b"}
    again = dataset(shards, tmp_path, context_length=16)
    assert all(torch.equal(data[i]["tokens"], again[i]["tokens"]) for i in range(50))  # a pure function
    other_seed = dataset(shards, tmp_path, context_length=16, seed=1)
    assert not all(torch.equal(data[i]["tokens"], other_seed[i]["tokens"]) for i in range(50))

    evaluation = dataset(shards, tmp_path, context_length=16, split="eval")
    assert len(evaluation) == (250 + 150) // 17
    for index in range(len(evaluation)):
        first = int(evaluation[index]["tokens"][0])
        assert 4750 <= first < 5000 or 32850 <= first < 33000  # only the held-out tail of each shard


def test_an_llmc_shard_is_read_after_its_header_whatever_dtype_says(tmp_path):
    (tmp_path / "llmc").mkdir()
    write_shard(tmp_path / "llmc" / "train_000.bin", np.arange(70000, 72000), dtype="uint32", llmc=True)
    data = dataset(tmp_path / "llmc", tmp_path, context_length=8)
    shard = data.shards[0]
    assert (shard.offset, shard.dtype, shard.tokens) == (LLMC_HEADER_BYTES, "uint32", 2000)
    first = int(data[0]["tokens"][0])
    assert torch.equal(data[0]["tokens"], torch.arange(first, first + 9)) and first >= 70000


def test_the_shards_headers_are_read_at_once_not_one_after_another(shards, tmp_path):
    """A start reads every shard's first bytes (is it llm.c's?): each a storage round trip, so they overlap."""
    both_in_flight = threading.Barrier(2, timeout=30)  # reading one header after the other breaks it

    class Watched(TokenShards):
        def _fetch(self, path, uri, start, end):
            if start == 0:
                both_in_flight.wait()
            return super()._fetch(path, uri, start, end)

    data = Watched(f"file://{shards}", cache_dir=str(tmp_path / "cache"), block_bytes=4096, context_length=16)
    assert [shard.uri.rsplit("/", 1)[1] for shard in data.shards] == ["a.bin", "b.bin"]  # in order still


@pytest.mark.parametrize(
    "damage, words",
    [
        (
            lambda d: (
                write_shard(d / "b.bin", np.arange(10), llmc=True)
                or (d / "b.bin").write_bytes((d / "b.bin").read_bytes()[:-6])
            ),
            "header says 10 uint16 tokens (1044 bytes), but the shard has 1038 bytes: truncated?",
        ),
        (lambda d: (d / "b.bin").write_bytes(b"\x01\x02\x03"), "3 bytes is not a whole number of uint16 tokens"),
    ],
    ids=["truncated-llmc", "odd-size"],
)
def test_a_damaged_shard_is_named_with_what_was_expected(shards, tmp_path, damage, words):
    damage(shards)
    with pytest.raises(DataError) as error:
        dataset(shards, tmp_path)
    assert f"file://{shards}/b.bin" in str(error.value) and words in str(error.value)


def test_an_empty_uri_and_a_too_short_split_say_what_to_do(tmp_path, shards):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no files matching '\*\.bin': check the URI"):
        dataset(tmp_path / "empty", tmp_path)
    with pytest.raises(DataError, match="no shard holds a window of context_length \\+ 1 = 5001 tokens in its train"):
        dataset(shards, tmp_path, context_length=5000)


@pytest.mark.parametrize(
    "argument,value,words",
    [
        ("block_bytes", 100, "block_bytes must be an integer of at least 4096"),
        ("read_ahead", -1, "read_ahead must be a whole number of items"),
        ("fetch_threads", 0, "fetch_threads must be a positive number of threads"),
    ],
)
def test_a_bad_tuning_argument_is_named(shards, tmp_path, argument, value, words):
    with pytest.raises(ValueError, match=words):
        TokenShards(f"file://{shards}", cache_dir=str(tmp_path / "cache"), **{argument: value})


def test_tokens_beyond_the_vocabulary_name_the_shard_and_the_byte(shards, tmp_path):
    data = dataset(shards, tmp_path, context_length=16, vocab_size=32000)
    with pytest.raises(DataError, match=r"b\.bin: token 3\d{4} at byte \d+ is not below vocab_size 32000"):
        for index in range(len(data)):
            data[index]


@pytest.fixture
def fetched(monkeypatch) -> list:
    """(file name, start, end) of every ranged read of a local shard, in order."""
    reads = []
    real = LocalFileSystem.cat_file

    def spy(self, path, start=None, end=None, **kwargs):
        reads.append((os.path.basename(path), start, end))
        return real(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "cat_file", spy)
    return reads


def test_only_the_blocks_of_a_window_are_fetched_and_then_served_from_the_cache(shards, tmp_path, fetched):
    data = dataset(shards, tmp_path, context_length=16)
    fetched.clear()  # listing read each shard's first 1024 bytes, to look for an llm.c header
    first = data[0]["tokens"]
    assert 1 <= len(fetched) <= 2 and all(end - start <= 4096 for _, start, end in fetched)  # a block or two
    fetched.clear()
    assert torch.equal(dataset(shards, tmp_path, context_length=16)[0]["tokens"], first)
    assert [f for f in fetched if (f[1], f[2]) != (0, LLMC_HEADER_BYTES)] == []  # the blocks came from the cache

    # The shard replaced in storage (another size): its blocks are fetched again, not served stale.
    write_shard(shards / "a.bin", np.arange(1, 6001) % 60000)
    write_shard(shards / "b.bin", np.arange(1, 3001) % 60000)
    fresh = dataset(shards, tmp_path, context_length=16)[0]["tokens"]
    assert int(fresh[0]) < 6001 and torch.equal(fresh, torch.arange(int(fresh[0]), int(fresh[0]) + 17))


def test_an_items_fetch_brings_its_blocks_into_the_cache_and_the_read_then_fetches_nothing(shards, tmp_path, fetched):
    data = dataset(shards, tmp_path, context_length=16)
    fetched.clear()
    fetch = data.missing(7)
    assert callable(fetch) and fetched == []  # looking costs no read
    fetch()
    assert 1 <= len(fetched) <= 2
    fetched.clear()
    assert data.missing(7) is None  # already cached: nothing to fetch, nothing read back
    window = data[7]["tokens"]
    assert fetched == [] and torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 17) % 60000)


def fetches_of(record, done, gate=None, niceness=None):
    """A `missing` for sampling.read_ahead whose fetch of item i appends i to `record` and sets `done[i]` (then waits
    for `gate`, when given; adds the nice value of the thread that fetched to `niceness`, when given)."""

    def missing(index):
        def fetch():
            if niceness is not None:
                niceness.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            record.append(index)
            done[index].set()
            if gate is not None:
                assert gate.wait(timeout=30)

        return fetch

    return missing


def test_read_ahead_keeps_the_samplers_order_and_fetches_ahead_of_it():
    from trainingrun_trainer.sampling import read_ahead

    sampler = ResumableSampler(100, rank=0, world_size=1, seed=3)
    order = list(sampler)
    asked, prefetched, done = [], [], {index: threading.Event() for index in order}
    fetched_at = set()
    fetch = fetches_of(prefetched, done, niceness=fetched_at)

    def missing(index):
        asked.append(index)
        if index % 7 == 0:
            raise DataError("the read reports this one")
        return None if index % 5 == 0 else fetch(index)  # every fifth is cached: nothing to hand to a thread

    handed = []
    for index in read_ahead(sampler, missing, ahead=10, threads=1):
        if not handed:  # when the first item is handed out, the eleventh has been looked at
            assert asked == order[:11]
        if index % 5 and index % 7:
            assert done[index].wait(timeout=30)
        handed.append(index)
    assert handed == order  # the sampler's order; a failed look is left for the read
    assert prefetched == [index for index in order if index % 5 and index % 7]
    # The fetch threads give way to the training thread (background.give_way_to_training).
    assert fetched_at == {helper_niceness()}


def test_fetches_begun_before_iterating_serve_it_and_are_dropped_when_the_position_moves():
    """begin() fetches the first items while the model builds and restores; iterating from the same position
    fetches none of them again; from a moved position (a resume) the fetches not started yet are dropped."""

    from trainingrun_trainer.sampling import read_ahead

    sampler = ResumableSampler(100, rank=0, world_size=1, seed=3, samples_per_step=4)
    order = list(sampler)
    prefetched, done = [], {index: threading.Event() for index in order}
    items = read_ahead(sampler, fetches_of(prefetched, done), ahead=10, threads=1)
    items.begin()
    assert done[order[10]].wait(timeout=30)  # before anyone iterates: the first ahead + 1 items, in order
    assert prefetched == order[:11]
    handed = []
    for index in items:
        assert done[index].wait(timeout=30)  # so every fetch queued before this one has run too
        handed.append(index)
    assert handed == order and prefetched == order  # each fetched once, in the sampler's order

    # begin(), then the position moves before the iteration: the queued early fetches never run.
    gate = threading.Event()
    prefetched.clear()
    done = {index: threading.Event() for index in order}
    items = read_ahead(sampler, fetches_of(prefetched, done, gate), ahead=10, threads=1)
    items.begin()
    assert done[order[0]].wait(timeout=30)  # the first early fetch is in flight, ten are queued
    sampler.advance(40)
    moved = iter(items)
    first = next(moved)
    gate.set()
    handed = [first]
    for index in moved:
        assert done[index].wait(timeout=30)
        handed.append(index)
    assert handed == order[40:] and prefetched == [order[0], *order[40:]]


def test_a_block_in_flight_is_waited_for_not_fetched_again(shards, tmp_path, fetched):
    """The read-ahead threads and the reader share the fetches of one process: a reader that needs a block being
    fetched waits for that fetch and reads it from the cache."""
    data = dataset(shards, tmp_path, context_length=16)
    fetched.clear()
    inside, release, reader_waits = threading.Event(), threading.Event(), threading.Event()
    real_fetch = data._fetch

    def slow_fetch(path, uri, start, end):
        inside.set()
        assert release.wait(timeout=30)
        return real_fetch(path, uri, start, end)

    class Watched(threading.Event):
        def wait(self, timeout=None):
            reader_waits.set()
            return super().wait(timeout)

    data._fetch = slow_fetch
    fetcher = threading.Thread(target=data.missing(7))
    fetcher.start()
    assert inside.wait(timeout=30)
    (key,) = data._fetching  # the block (item 7 lies in one 4 KiB block of its shard or two)
    data._fetching[key] = Watched()
    window = {}
    reader = threading.Thread(target=lambda: window.update(data[7]))
    reader.start()
    assert reader_waits.wait(timeout=30)
    release.set()
    fetcher.join(timeout=30)
    reader.join(timeout=30)
    assert torch.equal(window["tokens"], torch.arange(int(window["tokens"][0]), int(window["tokens"][0]) + 17))
    assert len(fetched) == len(set(fetched)) >= 1  # no block fetched twice


def test_a_dataloader_worker_forked_while_a_block_is_in_flight_fetches_it_itself(shards, tmp_path):
    """A worker forked while the parent's read-ahead fetched a block must not wait for that fetch: the thread that
    would end it is not in the worker (it waited forever: numWorkers 1 on cold GCS never took a step)."""
    data = dataset(shards, tmp_path, context_length=16)
    parent, inside, release = os.getpid(), threading.Event(), threading.Event()
    real_fetch = data._fetch

    def slow_in_the_parent(path, uri, start, end):
        if os.getpid() == parent:
            inside.set()
            assert release.wait(timeout=60)
        return real_fetch(path, uri, start, end)

    data._fetch = slow_in_the_parent
    fetcher = threading.Thread(target=data.missing(7))
    fetcher.start()
    try:
        assert inside.wait(timeout=30) and data._fetching  # forked with the block in flight
        loader = DataLoader(data, batch_size=1, sampler=[7], num_workers=1, multiprocessing_context="fork", timeout=30)
        (batch,) = list(loader)
    finally:
        release.set()
        fetcher.join(timeout=30)
    assert torch.equal(batch["tokens"][0], data[7]["tokens"])


def test_a_shard_gone_after_listing_is_named(shards, tmp_path):
    data = dataset(shards, tmp_path, context_length=16)
    (shards / "a.bin").unlink()
    (shards / "b.bin").unlink()
    with pytest.raises(DataError, match=r"tokens/[ab]\.bin: gone from storage since it was listed"):
        data[0]


def test_dataloader_workers_and_the_sampler_serve_each_window_once_across_a_world_size_change(shards, tmp_path):
    data = dataset(shards, tmp_path, context_length=16, num_samples=64)
    assert pickle.loads(pickle.dumps(data))[3]["tokens"].equal(data[3]["tokens"])  # workers get a copy

    def served(sampler, steps):
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
        return [tuple(t.tolist()) for _, batch in zip(range(steps), loader) for t in batch["tokens"]]

    two = [ResumableSampler(len(data), rank=r, world_size=2, seed=0, samples_per_step=4) for r in range(2)]
    first = served(two[0], 3) + served(two[1], 3)
    for sampler in two:
        sampler.advance(3 * 8)  # three steps of both ranks, then the job shrinks to one rank
    one = ResumableSampler(len(data), rank=0, world_size=1, seed=0, samples_per_step=4)
    one.load_state_dict(two[0].state_dict())
    rest = served(one, len(one) // 4)
    everything = [tuple(data[i]["tokens"].tolist()) for i in range(64)]
    assert sorted(first + rest) == sorted(everything)  # every item of the epoch once, none twice


def test_an_eval_dataset_of_its_own_reads_all_of_its_files_and_the_training_files_can_be_all_training(tmp_path):
    """eval.dataset: a user's validation file is all eval (evalFraction 1 unless set), and data.dataset's
    evalFraction 0 trains on every token of the training files."""
    from trainingrun_api import components
    from trainingrun_api.config import TrainerConfig

    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    write_shard(tmp_path / "train" / "a.bin", np.arange(0, 1700))
    write_shard(tmp_path / "val" / "a.bin", np.arange(5000, 5170))
    shard_args = {"cacheDir": str(tmp_path / "cache"), "blockBytes": 4096, "contextLength": 16}
    trainer = TrainerConfig.from_wire(
        {
            "data": {"dataset": {"classPath": "trainingrun_trainer.shards.TokenShards",
                                 "initArgs": {"uri": f"file://{tmp_path}/train", "evalFraction": 0, **shard_args}}},
            "eval": {"intervalSteps": 5,
                     "dataset": {"classPath": "trainingrun_trainer.shards.TokenShards",
                                 "initArgs": {"uri": f"file://{tmp_path}/val", **shard_args}}},
        }
    )  # fmt: skip
    assert [field for _, field, _ in components.named_classes(trainer)][-1] == "spec.trainer.eval.dataset"
    evaluated, field, extra = components.evaluated_dataset(trainer)
    held_out = components.build(evaluated, field, **extra)
    starts = {int(held_out[i]["tokens"][0]) for i in range(len(held_out))}
    assert len(held_out) == 170 // 17 and min(starts) >= 5000  # every window from the validation file
    assert max(starts) >= 5170 - 17 - 16  # ... up to its end, not its last 5%
    train = components.build(trainer.data.dataset, "spec.trainer.data.dataset", split="train")
    assert len(train) == 1700 // 17  # no held-out part


def test_an_eval_dataset_needs_an_evaluation_interval():
    from pydantic import ValidationError

    from trainingrun_api.config import TrainerConfig

    with pytest.raises(ValidationError, match="dataset is set but intervalSteps is 0"):
        TrainerConfig.from_wire({"eval": {"dataset": {"classPath": "trainingrun_trainer.data.SyntheticText"}}})
