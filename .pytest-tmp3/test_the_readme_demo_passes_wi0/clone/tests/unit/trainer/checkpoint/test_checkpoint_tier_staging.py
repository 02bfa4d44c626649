"""Stage once (checkpoint.tier_staging): persisting behind, the tensors a save copies in the background go straight
into the rank's data file in the memory tier, which the save completes in place."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from checkpoint_states import app_state, make_model, step_dir, train_step, trained
from test_checkpoint_memory_tier import restored
from test_checkpoint_persisting import behind, bucket, memory, steps_in  # noqa: F401 - fixtures

from trainingrun_trainer.checkpoint import CheckpointStore, model_digest, tier_staging
from trainingrun_trainer.checkpoint.tier_files import SPARE_DIR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: runs on the GPU machine")


def save_as_the_trainer_does(store: CheckpointStore, step: int, model, opt) -> None:
    """The trainer's save: weights and moments copied in the background, the model digest from the staged copy."""
    store.save(
        step,
        app_state(model, opt),
        {"step": step},
        copy_in_background=("model", "optim"),
        model_digest=lambda staged: model_digest(staged["model"]),
    )


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
        "big": torch.randn(1000, 33, generator=gen),
        "tied": shared,
        "tied_again": shared,
        "transposed": torch.randn(9, 40, generator=gen).t(),
        "empty": torch.empty(0, 3),
        "flags": torch.rand(77, generator=gen) > 0.5,
        "half": torch.randn(13, generator=gen).to(torch.bfloat16),
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
    assert data.read_bytes()[: big.nbytes] == big.numpy().tobytes()
    target = {
        "weights": {name: torch.zeros_like(t) for name, t in tensors.items()},
        "groups": [{"lr": 0.0, "params": []}],
        "ema": {"buffer": torch.zeros_like(shared)},
    }
    for root, tier in ((bucket, memory), (bucket, None)):
        with CheckpointStore(root.as_uri(), memory_tier=str(tier) if tier else None) as reader:
            reader.load(reader.latest_valid(), target)
        assert torch.equal(target["weights"]["big"], big)
        for name in ("tied", "tied_again", "transposed", "empty", "flags", "half", "step"):
            assert torch.equal(target["weights"][name], tensors[name]), name
        assert target["groups"] == [{"lr": 0.25, "params": [0, 1]}]
        assert torch.equal(target["ema"]["buffer"], shared)


@pytest.mark.parametrize("segments", [4, 1])
def test_a_staged_file_records_the_digests_of_its_bytes(bucket, memory, segments):
    """Segments are hashed on a pool beside the file digest (one segment on the saving thread): each must be the
    xxh3_128 of its own bytes, the last one running from the staged tensors into the byte items written after them."""
    import xxhash
    from test_checkpoint_memory_tier import digests_file

    from trainingrun_trainer.checkpoint import tier_files

    elements = 3 * tier_files.SEGMENT_BYTES // 4 + 1001 if segments > 1 else 1001
    big = torch.randn(elements, generator=torch.Generator().manual_seed(8))
    with behind(bucket, memory) as store:
        store.save(1, {"weights": {"big": big}}, {"step": 1}, copy_in_background=("weights",))
        assert store.flush() is not None
    [data] = step_dir(memory, 1).glob("*.distcp")
    content = data.read_bytes()
    expected = tier_files.SegmentHasher()
    expected.update(content)
    recorded = json.loads(digests_file(data).read_text())
    assert len(recorded["xxh3_128"]) == segments and recorded["xxh3_128"] == expected.finish()
    assert recorded["file_digest"][1] == xxhash.xxh3_128(content).hexdigest() and recorded["size"] == len(content)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def test_a_rank_stages_into_its_file_only_the_tensors_its_plan_writes(tmp_path, device):
    planned, digested, elsewhere = (
        torch.arange(1000.0, device=device),
        torch.ones(300, device=device),
        torch.full((500,), 2.0, device=device),
    )
    tree = {"model": {"planned": planned, "digested": digested}, "optim": {"elsewhere": elsewhere, "lr": 0.1}}
    staged_file = tier_staging.StagedFile(str(tmp_path / tier_staging.data_file_name(1)))
    staged = staged_file.stage(tree, planned=[planned], also_copied=[digested])
    planned.zero_(), digested.zero_(), elsewhere.zero_()  # training goes on
    try:
        assert staged_file.size == -(-planned.nbytes // tier_staging.ALIGN) * tier_staging.ALIGN  # what the plan writes
        assert staged["model"]["planned"].tolist() == list(range(1000))
        assert staged["model"]["digested"].tolist() == [1.0] * 300  # copied, outside the file
        assert staged["model"]["digested"].device.type == "cpu"
        placeholder = staged["optim"]["elsewhere"]
        assert placeholder.device.type == "meta" and placeholder.shape == (500,) and placeholder.dtype == torch.float32
        assert staged["optim"]["lr"] == 0.1
    finally:
        staged_file.close()


def test_the_padding_between_staged_tensors_is_zeros_even_in_a_recycled_file(tmp_path):
    """Another pod stages the same tensors into its copy of this file (`mirroring`): the bytes between them must be
    the same there, whatever the recycled pages held before."""
    tier = tmp_path / "tier"
    (tier / SPARE_DIR).mkdir(parents=True)
    name = tier_staging.data_file_name(0)
    (tier / SPARE_DIR / name).write_bytes(b"\xff" * 4096)  # another save's bytes
    (tier / "step-00000001").mkdir()
    odd, small = torch.ones(5, dtype=torch.float32), torch.ones(3, dtype=torch.int16)  # 20 and 6 bytes
    staged_file = tier_staging.StagedFile(str(tier / "step-00000001" / name))
    try:
        staged_file.stage({"a": odd, "b": small})
        offsets, end, _ = tier_staging.staging_layout({"a": odd, "b": small})
        assert staged_file.size == end == 2 * tier_staging.ALIGN
        content = (tier / "step-00000001" / name).read_bytes()
        assert content[20:64] == bytes(44) and content[64 + 6 :] == bytes(end - 70)
        assert content[:20] == odd.numpy().tobytes() and content[64:70] == small.numpy().tobytes()
    finally:
        staged_file.close()


def no_room_to_stage(monkeypatch) -> None:
    def full(fd, offset, length):  # /dev/shm filled by something else since the room check
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_staging.os, "posix_fallocate", full)


def test_a_first_save_that_finds_no_room_to_stage_in_memory_commits_to_storage(bucket, memory, monkeypatch, caplog):
    model, opt = trained()
    with behind(bucket, memory) as store:
        no_room_to_stage(monkeypatch)
        digest = model_digest(model.state_dict())
        with caplog.at_level(logging.INFO):
            save_as_the_trainer_does(store, 1, model, opt)
            store.wait_copied()
            info = store.wait()
        assert info.step == 1 and store.in_storage == info
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot stage its state" in m and "No space left" in m and "commits to storage" in m for m in messages)
    assert any("committed checkpoint step 1 to" in m for m in messages)
    assert steps_in(bucket) == [1] and 1 not in steps_in(memory)
    assert restored(bucket, None) == (1, digest, "storage")


def test_a_repeated_save_that_finds_no_room_to_stage_fails_alone_and_the_next_one_commits(
    bucket, memory, monkeypatch, caplog
):
    """A save written by the last plan stages only what that plan writes, so it cannot fall back to storage, where DCP
    plans afresh and may ask this rank for any tensor: it fails, with the reason, and nothing committed is lost."""
    model, opt = trained()
    with behind(bucket, memory) as store:
        save_as_the_trainer_does(store, 1, model, opt)
        assert store.flush().step == 1
        with monkeypatch.context() as patched:
            no_room_to_stage(patched)
            train_step(model, opt, seed=2)
            with caplog.at_level(logging.INFO):
                save_as_the_trainer_does(store, 2, model, opt)
                store.wait_copied()
                assert store.wait() is None
        assert store.metrics.failed_saves == 1 and store.in_memory.step == 1
        train_step(model, opt, seed=3)
        digest = model_digest(model.state_dict())
        save_as_the_trainer_does(store, 3, model, opt)
        assert store.flush().step == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot stage its state" in m and "No space left" in m and "this save fails" in m for m in messages)
    assert "checkpoint step 2: rank 0 had no room in node memory to stage its state after all" in messages
    assert 2 not in steps_in(memory) and 2 not in steps_in(bucket)
    assert restored(bucket, memory) == (3, digest, "memory")


@pytest.fixture
def shm_memory(memory):
    """A memory tier in /dev/shm, the node memory a tier lives in (the `memory` fixture's is under tmp_path)."""
    root = tempfile.mkdtemp(prefix="tier-staging-test-", dir="/dev/shm")
    yield Path(root) / memory.name
    shutil.rmtree(root, ignore_errors=True)


@NEEDS_CUDA
def test_gpu_tensors_are_copied_from_the_device_into_locked_memory_pages_and_restore_as_saved(
    bucket, shm_memory, monkeypatch
):
    """In /dev/shm as in a pod: CUDA locks the pages of a memory-backed file; a file on disk it refused (H200)."""
    memory = shm_memory
    locked = []
    real_pin = tier_staging._pin
    monkeypatch.setattr(tier_staging, "_pin", lambda pages: locked.append(real_pin(pages)) or locked[-1])
    model = make_model(5).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        model(torch.randn(5, 8, generator=gen).cuda()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step(1)
    with behind(bucket, memory) as store:
        saved_digest = model_digest(model.state_dict())
        save_as_the_trainer_does(store, 3, model, opt)
        store.wait_copied()
        step(2)  # queued on the device right behind the copies: they must have taken the weights before it
        info = store.wait()
        assert info is not None and info.model_digest == saved_digest != model_digest(model.state_dict())
        assert store.flush() == info
    assert locked == [True]  # copied straight from the device into the file's pages, locked for the copy
    assert restored(bucket, memory) == (3, saved_digest, "memory")
    assert restored(bucket, None) == (3, saved_digest, "storage")


@NEEDS_CUDA
def test_where_pages_cannot_be_locked_gpu_tensors_are_copied_through_pageable_memory(bucket, memory, monkeypatch):
    monkeypatch.setattr(tier_staging, "_pin", lambda pages: False)  # a runtime that cannot lock them
    state = {"weights": {"w": torch.arange(1000.0, device="cuda"), "b": torch.ones(3, device="cuda")}}
    with behind(bucket, memory) as store:
        store.save(1, state, {"step": 1}, copy_in_background=("weights",))
        store.wait_copied()
        state["weights"]["w"].zero_()
        assert store.flush() is not None
    target = {"weights": {"w": torch.zeros(1000), "b": torch.zeros(3)}}
    with CheckpointStore(bucket.as_uri(), memory_tier=str(memory)) as reader:
        reader.load(reader.latest_valid(), target)
        assert reader.metrics.last_restore_source == "memory"
    assert torch.equal(target["weights"]["w"], torch.arange(1000.0)) and torch.equal(
        target["weights"]["b"], torch.ones(3)
    )


def test_tier_files_are_locked_once_and_let_go_when_deleted_replaced_or_released(tmp_path, monkeypatch):
    """LockedMappings' bookkeeping, with locking recorded instead of done (no GPU needed)."""
    locked, unlocked = [], []
    monkeypatch.setattr(tier_staging, "_pin", lambda pages: locked.append(pages.data_ptr()) or True)
    monkeypatch.setattr(tier_staging, "_unpin", lambda pages: unlocked.append(pages.data_ptr()))
    mappings = tier_staging.LockedMappings(keep=2)

    fds = []

    def opened(name: str, size: int = 4096) -> int:
        fds.append(os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o600))
        os.ftruncate(fds[-1], size)
        return fds[-1]

    a = opened("a")
    first, is_locked = mappings.mapping(a, 4096)
    again, _ = mappings.mapping(opened("a"), 4096)  # the same file (inode) staged into again: locked once
    assert is_locked and again.data_ptr() == first.data_ptr() and locked == [first.data_ptr()] and not unlocked
    os.replace(tmp_path / "a", tmp_path / "renamed")  # the tier recycling it as the spare: still the same file
    assert mappings.mapping(opened("renamed"), 4096)[0].data_ptr() == first.data_ptr() and len(locked) == 1
    bigger, _ = mappings.mapping(opened("renamed", 8192), 8192)  # another size: mapped and locked anew
    assert unlocked == [first.data_ptr()] and locked[-1] == bigger.data_ptr()
    b = mappings.mapping(opened("b"), 4096)[0]
    mappings.mapping(opened("c"), 4096)
    assert unlocked[-1] == bigger.data_ptr()  # past `keep`: the least recently staged goes
    os.unlink(tmp_path / "b")
    mappings.mapping(opened("d"), 4096)
    assert b.data_ptr() in unlocked  # deleted: let go at the next stage, not kept alive by us
    mappings.release()
    assert set(locked) == set(unlocked)  # every lock undone
    for fd in fds:
        os.close(fd)


def test_only_plain_cpu_and_cuda_tensors_are_staged_into_memory():
    class Tagged(torch.Tensor):
        pass

    assert tier_staging.stageable({"a": [torch.zeros(2), {"b": torch.nn.Parameter(torch.ones(1))}], "c": 3})
    assert not tier_staging.stageable({"a": torch.zeros(2).as_subclass(Tagged)})
    assert not tier_staging.stageable({"a": [torch.empty(2, device="meta")]})
    if torch.cuda.is_available():
        assert tier_staging.stageable({"a": torch.zeros(2, device="cuda"), "b": torch.zeros(1)})
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
