"""checkpoint.writerProcess: a separate process writes a rank's files (checkpoint/writer_process.py)."""

from __future__ import annotations

import json
import logging
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from test_checkpoint import app_state, make_model, step_dir, train_step, trained

from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore, memory_tier, model_digest, saving
from trainingrun_trainer.checkpoint.writer_process import WriterProcess

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def writing_store(uri, **kwargs) -> CheckpointStore:
    """A store whose writer process has started (until then saves are written in-process)."""
    store = CheckpointStore(uri, writer_process=True, **kwargs)
    assert store._writer.wait_ready(120)
    return store


def manifest_files(root, step) -> dict:
    manifest = json.loads((step_dir(root, step) / MANIFEST_NAME).read_text())
    return {entry["path"]: (entry["size"], entry["xxh3_128"]) for entry in manifest["files"]}


def test_the_writer_process_writes_what_the_training_process_would(tmp_path):
    model, opt = trained()
    for name, writer_process in (("thread", False), ("process", True)):
        with (writing_store if writer_process else CheckpointStore)((tmp_path / name).as_uri()) as store:
            store.save(5, app_state(model, opt), {"step": 5, "rng": torch.get_rng_state()})
            assert store.wait() is not None
    process, thread = manifest_files(tmp_path / "process", 5), manifest_files(tmp_path / "thread", 5)
    # The data files byte for byte; .metadata pickles the write results, whose strings came back through a pipe as
    # copies (pickle repeats them instead of referring back), and names its own directory.
    assert process.keys() == thread.keys() and len(process) > 1
    assert {name: entry for name, entry in process.items() if name != ".metadata"} == {
        name: entry for name, entry in thread.items() if name != ".metadata"
    }


def test_the_staged_state_is_the_state_at_save_time_though_training_goes_on_and_buffers_are_reused(tmp_path):
    model, opt = trained()
    digests = {}
    with writing_store(tmp_path.as_uri(), keep=5) as store:
        for step in (1, 2, 3):
            digests[step] = model_digest(model.state_dict())
            store.save(step, app_state(model, opt), {"step": step})
            train_step(model, opt, seed=step)  # changes the very tensors being written
            assert store.wait() is not None
        for step in (1, 2, 3):
            restored, restored_opt = trained(seed=9)
            state = app_state(restored, restored_opt)
            assert store.load(step_dir(tmp_path, step).as_uri(), state)["step"] == step
            restored.load_state_dict(state["model"])
            assert model_digest(restored.state_dict()) == digests[step]


def test_a_writer_that_dies_mid_save_commits_nothing_and_training_goes_on(tmp_path, caplog):
    model, opt = trained()
    with writing_store(tmp_path.as_uri()) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait() is not None
        first_writer = store._writer.pid
        store.writer_dies_at_step = 2
        train_step(model, opt, seed=2)
        with caplog.at_level(logging.ERROR, logger="trainingrun.checkpoint"):
            store.save(2, app_state(model, opt), {"step": 2})  # never raises into the training loop
            assert store.wait() is None
        assert store.failed_saves == 1
        assert "WriterDied" in caplog.text and "exit code -9" in caplog.text
        partial = step_dir(tmp_path, 2)
        assert partial.is_dir() and not (partial / MANIFEST_NAME).exists()  # begun, never committed
        assert store.latest_valid().step == 1
        train_step(model, opt, seed=3)
        assert store._writer.wait_ready(120) and store._writer.pid != first_writer  # a new writer
        store.save(3, app_state(model, opt), {"step": 3})
        assert store.wait() is not None
        assert store.latest_valid().step == 3


def test_without_room_in_shared_memory_saves_are_written_in_process_with_one_warning(tmp_path, monkeypatch, caplog):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 10 << 20))
    monkeypatch.setattr(WriterProcess, "write", lambda *a: pytest.fail("the writer process was used"))
    model, opt = trained()
    with writing_store(tmp_path.as_uri()) as store, caplog.at_level(logging.WARNING, logger="trainingrun.checkpoint"):
        for step in (1, 2):
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait() is not None
    assert caplog.text.count("not by the writer process") == 1


def test_saves_before_the_writer_has_started_are_written_in_process(tmp_path, monkeypatch):
    monkeypatch.setattr(WriterProcess, "ready", lambda self: False)  # still importing torch
    monkeypatch.setattr(WriterProcess, "write", lambda *a: pytest.fail("a save waited for the writer process"))
    model, opt = trained()
    with CheckpointStore(tmp_path.as_uri(), writer_process=True) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait() is not None


def test_the_writer_process_fills_the_memory_tier(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", 0.0)  # the tier is on the test machine's disk, not /dev/shm
    model, opt = trained()
    tier = tmp_path / "shm" / "tier"
    with writing_store((tmp_path / "bucket").as_uri(), memory_tier=str(tier)) as store:
        store.save(5, app_state(model, opt), {"step": 5})
        assert store.wait() is not None
    restarted, restarted_opt = trained(seed=7)
    state = app_state(restarted, restarted_opt)
    with CheckpointStore((tmp_path / "bucket").as_uri(), memory_tier=str(tier)) as store:
        assert store.load(store.latest_valid(), state)["step"] == 5
        assert store.last_restore_source == "memory"
    restarted.load_state_dict(state["model"])
    assert model_digest(restarted.state_dict()) == model_digest(model.state_dict())


def test_a_stop_signal_for_the_whole_process_group_leaves_the_writer_to_write_the_emergency_checkpoint(tmp_path):
    import os
    import signal

    model, opt = trained()
    with writing_store(tmp_path.as_uri()) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait() is not None
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # what Ctrl-C or a group's SIGTERM sends
            os.kill(store._writer.pid, stop)
        writer = store._writer.pid
        store.save(2, app_state(model, opt), {"step": 2}, blocking=True)
        assert store.wait() is not None and store._writer.pid == writer  # the same writer wrote it


def _fsdp2_worker(rank: int, world: int, init_file: str, uri: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int):
        model = make_model(seed)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, opt = sharded(0)
        train_step(model, opt, seed=100)
        expected = model_digest(get_model_state_dict(model))  # gathers the full tensors: every rank
        with writing_store(uri) as store:
            written = []
            real_write = store._writer.write
            store._writer.write = lambda request: written.append(len(request.plan.items)) or real_write(request)
            store.save(5, app_state(model, opt), {"rank": rank}, model_digest=expected)
            assert store.wait() is not None
        fresh, fresh_opt = sharded(1)
        state = app_state(fresh, fresh_opt)
        with CheckpointStore(uri) as store:
            extra = store.load(store.latest_valid(), state)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": extra["rank"],
                    "written": written,
                    "expected": expected,
                    "digest": model_digest(get_model_state_dict(fresh)),
                }
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_shards_are_written_by_each_ranks_writer_process_and_load_back(tmp_path):
    import torch.multiprocessing as mp

    uri = (tmp_path / "ckpt").as_uri()
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "pg-store"), uri, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["written"] and r["written"][0] > 0 for r in results)  # each rank's shards went to its writer
    assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]
    files = manifest_files(tmp_path / "ckpt", 5)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files)
    # The sharded checkpoint loads into one plain process with the same weights.
    model = make_model(2)
    state = {"model": model.state_dict()}
    with CheckpointStore(uri) as store:
        store.load(store.latest_valid(), state)
    assert model_digest(state["model"]) == results[0]["expected"]
