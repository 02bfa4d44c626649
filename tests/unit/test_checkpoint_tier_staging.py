"""Stage once (checkpoint.tier_staging): persisting behind, the tensors a save copies in the background go straight
into the rank's data file in the memory tier, which the save completes in place."""
from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch

from trainingrun_trainer.checkpoint import CheckpointStore, model_digest, tier_staging

from test_checkpoint import app_state, step_dir, train_step, trained
from test_checkpoint_memory_tier import restored
from test_checkpoint_persist_behind import behind, bucket, memory, steps_in  # noqa: F401 - fixtures

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_as_the_trainer_does(store: CheckpointStore, step: int, model, opt) -> None:
    """The trainer's save: weights and moments copied in the background, the model digest from the staged copy."""
    store.save(step, app_state(model, opt), {"step": step}, copy_in_background=("model", "optim"),
               model_digest=lambda staged: model_digest(staged["model"]))


def test_a_state_staged_into_memory_restores_as_it_was_at_save_time_though_training_went_on(bucket, memory):
    model, opt = trained()
    with behind(bucket, memory) as store:
        saved_digest = model_digest(model.state_dict())
        save_as_the_trainer_does(store, 4, model, opt)
        store.wait_copied()
        train_step(model, opt, seed=7)  # changes the very tensors being saved while the save completes
        info = store.wait()
        assert info is not None and info.model_digest == saved_digest != model_digest(model.state_dict())
        assert store.flush() == info
    assert restored(bucket, memory) == (4, saved_digest, "memory")
    assert restored(bucket, None) == (4, saved_digest, "storage")


def test_tied_non_contiguous_empty_and_odd_dtype_tensors_are_staged_and_restored(bucket, memory):
    gen = torch.Generator().manual_seed(3)
    shared = torch.randn(300, 7, generator=gen)
    tensors = {
        "big": torch.randn(1000, 33, generator=gen), "tied": shared, "tied_again": shared,
        "transposed": torch.randn(9, 40, generator=gen).t(), "empty": torch.empty(0, 3),
        "flags": torch.rand(77, generator=gen) > 0.5, "half": torch.randn(13, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(12, dtype=torch.int64),
    }
    # `shared` also in another entry, as EMA state holds the model's buffers
    state = {"weights": dict(tensors), "groups": [{"lr": 0.25, "params": [0, 1]}], "ema": {"buffer": shared}}
    big = tensors["big"].clone()
    with behind(bucket, memory) as store:
        store.save(1, state, {"step": 1}, copy_in_background=("weights", "ema"))
        store.wait_copied()
        tensors["big"].zero_()  # after the copy: not in the checkpoint
        assert store.flush() is not None
    [data] = step_dir(memory, 1).glob("*.distcp")
    # Staged straight into the file, largest tensor first: its bytes open the file (DCP's writer puts byte items first).
    assert data.read_bytes()[:big.nbytes] == big.numpy().tobytes()
    target = {"weights": {name: torch.zeros_like(t) for name, t in tensors.items()}, "groups": [{"lr": 0.0, "params": []}],
              "ema": {"buffer": torch.zeros_like(shared)}}
    for root, tier in ((bucket, memory), (bucket, None)):
        with CheckpointStore(root.as_uri(), memory_tier=str(tier) if tier else None) as reader:
            reader.load(reader.latest_valid(), target)
        assert torch.equal(target["weights"]["big"], big)
        for name in ("tied", "tied_again", "transposed", "empty", "flags", "half", "step"):
            assert torch.equal(target["weights"][name], tensors[name]), name
        assert target["groups"] == [{"lr": 0.25, "params": [0, 1]}]
        assert torch.equal(target["ema"]["buffer"], shared)


def test_a_save_that_finds_no_room_to_stage_in_memory_commits_to_storage(bucket, memory, monkeypatch, caplog):
    model, opt = trained()
    with behind(bucket, memory) as store:
        save_as_the_trainer_does(store, 1, model, opt)
        assert store.flush().step == 1

        def full(fd, offset, length):  # /dev/shm filled by something else since the room check
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tier_staging.os, "posix_fallocate", full)
        train_step(model, opt, seed=2)
        digest = model_digest(model.state_dict())
        with caplog.at_level(logging.INFO):
            save_as_the_trainer_does(store, 2, model, opt)
            store.wait_copied()
            info = store.wait()
        assert info.step == 2 and store.in_storage == info
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot stage its state" in m and "No space left" in m for m in messages)
    assert any("committed checkpoint step 2 to" in m for m in messages)
    assert steps_in(bucket) == [1, 2] and 2 not in steps_in(memory)
    assert restored(bucket, None) == (2, digest, "storage")


def test_only_plain_cpu_tensors_are_staged_into_memory():
    class Tagged(torch.Tensor):
        pass

    assert tier_staging.stageable({"a": [torch.zeros(2), {"b": torch.nn.Parameter(torch.ones(1))}], "c": 3})
    assert not tier_staging.stageable({"a": torch.zeros(2).as_subclass(Tagged)})
    assert not tier_staging.stageable({"a": [torch.empty(2, device="meta")]})
    assert not tier_staging.stageable({"a": torch.zeros(3, 3).to_sparse()})


class Recorded:
    """A Stateful that records the thread that takes its state_dict()."""

    def __init__(self, tensors: dict):
        self.tensors, self.threads = tensors, []

    def state_dict(self) -> dict:
        self.threads.append(threading.current_thread() is threading.main_thread())
        return dict(self.tensors)

    def load_state_dict(self, state: dict) -> None:
        self.tensors.update(state)


class Sharded(torch.Tensor):
    """Stands for a DTensor: not a plain tensor."""


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_after_the_first_save_the_background_takes_the_state_dict_of_plain_tensors_only(bucket, memory, sharded):
    weights = torch.arange(6.0)
    entry = Recorded({"w": weights.as_subclass(Sharded) if sharded else weights})
    with behind(bucket, memory) as store:
        for step in (1, 2, 3):
            store.save(step, {"model": entry}, {"step": step}, copy_in_background=("model",))
            store.wait_copied()
            assert store.wait() is not None
    # on the training thread: the first save (which finds out), and every save of sharded state (a collective there)
    assert entry.threads == ([True, True, True] if sharded else [True, False, False])
