"""Persisting behind (CheckpointStore(persist_behind=True)): a save commits in the memory tier, rank 0 copies it to
storage behind it, newest first; a restart loads the newest memory checkpoint, a new pod the newest in storage."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from checkpoint_states import app_state, flip_byte, spawned, step_dir, train_step, trained
from test_checkpoint_memory_tier import data_files, restored

from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore, memory_tier, model_digest, tier_files
from trainingrun_trainer.checkpoint import storage as storage_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def bucket(tmp_path) -> Path:
    return tmp_path / "bucket"


@pytest.fixture
def memory(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(
        memory_tier, "RESERVE_SHARE", 0.0
    )  # as test_checkpoint_memory_tier's fixture, for the same reason
    return tmp_path / "shm" / "trainingrun-uid-attempt-1"


def behind(bucket: Path, memory: Path) -> CheckpointStore:
    return CheckpointStore(bucket.as_uri(), memory_tier=str(memory), persist_behind=True)


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / MANIFEST_NAME).exists())


def storage_unreachable(monkeypatch) -> None:
    """Every copy to storage fails from now on (until `monkeypatch.undo()`)."""

    def unreachable(storage, path, uri, *digest):
        raise OSError("storage unreachable")

    monkeypatch.setattr(storage_module.Storage, "upload", unreachable)


class GatedUploads:
    """Holds the persister inside its first upload until `release`; `entered` is set once it is there."""

    def __init__(self, monkeypatch):
        self.entered, self.released = threading.Event(), threading.Event()
        upload = storage_module.Storage.upload

        def gated(storage, path, uri, *digest):
            self.entered.set()
            assert self.released.wait(60), "the test never released the upload"
            upload(storage, path, uri, *digest)

        monkeypatch.setattr(storage_module.Storage, "upload", gated)

    def release(self) -> None:
        self.released.set()


def test_a_save_commits_in_memory_first_and_reaches_storage_behind_it(bucket, memory, monkeypatch):
    gate = GatedUploads(monkeypatch)
    model, opt = trained()
    with behind(bucket, memory) as store:
        assert store.persist_behind
        store.save(5, app_state(model, opt), {"step": 5})
        info = store.wait()  # committed while its copy to storage is held
        assert info is not None and info.step == 5 and store.in_memory == info
        assert gate.entered.wait(60)
        assert steps_in(memory) == [5] and steps_in(bucket) == []
        assert store.in_storage is None and store.persist_lag_steps == 5
        gate.release()
        assert store.flush() == info
        assert store.persist_lag_steps == 0 and store.metrics.last_persist_seconds > 0
    [found] = CheckpointStore(bucket.as_uri()).list(verify=True)  # every file re-hashed against the manifest
    assert found.valid and found.step == 5 and found.manifest_sha256 == info.manifest_sha256
    assert (step_dir(bucket, 5) / MANIFEST_NAME).read_bytes() == (step_dir(memory, 5) / MANIFEST_NAME).read_bytes()


def test_a_newer_memory_checkpoint_supersedes_one_waiting_for_storage(bucket, memory, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    gate = GatedUploads(monkeypatch)
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait() is not None and gate.entered.wait(60)  # step 1 is being copied
        for step in (2, 3):
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait() is not None  # training never waits for storage
        assert steps_in(memory) == [1, 3]  # the one being copied and the newest; 2 was superseded
        gate.release()
        assert store.flush().step == 3
        assert store.metrics.superseded_persists == 1 and store.metrics.failed_persists == 0
        digest = model_digest(model.state_dict())
    assert steps_in(bucket) == [1, 3]
    assert steps_in(memory) == [3]
    assert any("step 2 is not persisted: step 3 supersedes it" in r.getMessage() for r in caplog.records)
    assert restored(bucket, None) == (3, digest, "storage")  # a new pod


def test_a_restart_resumes_from_memory_what_storage_never_got(bucket, memory, monkeypatch, caplog):
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.flush().step == 1
        storage_unreachable(monkeypatch)
        train_step(model, opt, seed=2)
        store.save(2, app_state(model, opt), {"step": 2})
        assert store.wait().step == 2
        assert store.flush().step == 1 and store.metrics.failed_persists == 1
        digest = model_digest(model.state_dict())
    assert any("step 2 (committed in memory) could not be copied" in r.getMessage() for r in caplog.records)
    assert steps_in(bucket) == [1] and steps_in(memory) == [2]
    monkeypatch.undo()
    model, opt = trained(seed=99)
    state = app_state(model, opt)
    with behind(bucket, memory) as store:  # the workers restarted inside the pod
        info = store.latest_valid()
        assert info.step == 2 and store.in_storage.step == 1 and store.persist_lag_steps == 1
        assert store.load(info, state) == {"step": 2}
        assert store.metrics.last_restore_source == "memory"
    model.load_state_dict(state["model"])
    assert model_digest(model.state_dict()) == digest


@pytest.mark.parametrize("in_background", [(), ("model", "optim")], ids=["staged-first", "staged-into-the-tier"])
def test_a_damaged_memory_checkpoint_that_storage_lacks_fails_once_then_the_restart_takes_storages(
    bucket, memory, monkeypatch, in_background
):
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.flush().step == 1
        older = model_digest(model.state_dict())
        monkeypatch.setattr(storage_module.Storage, "upload", lambda *_: (_ for _ in ()).throw(OSError("down")))
        train_step(model, opt, seed=2)
        store.save(2, app_state(model, opt), {"step": 2}, copy_in_background=in_background)
        assert store.wait().step == 2
    monkeypatch.undo()
    flip_byte(max(data_files(step_dir(memory, 2)), key=lambda p: p.stat().st_size))
    model, opt = trained(seed=99)
    with behind(bucket, memory) as store:
        info = store.latest_valid()
        assert info.step == 2
        with pytest.raises(OSError, match="its copy in memory is damaged"):
            store.load(info, app_state(model, opt))
    assert not step_dir(memory, 2).exists()  # the next restart does not find it again
    assert restored(bucket, memory) == (1, older, "storage")


def test_without_room_in_memory_a_save_commits_to_storage_as_before(bucket, memory, monkeypatch, caplog):
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.flush().step == 1
        monkeypatch.setattr(
            memory_tier.shutil,
            "disk_usage",
            lambda _: memory_tier.shutil._ntuple_diskusage(1 << 30, 1 << 30, memory_tier.RESERVE_BYTES),
        )
        train_step(model, opt, seed=2)
        with caplog.at_level(logging.INFO):
            store.save(2, app_state(model, opt), {"step": 2})
            info = store.wait()  # returns once storage holds it: nothing is left to persist
        assert info.step == 2 and store.in_storage == info and store.in_memory == info
        assert any("committed checkpoint step 2 to" in r.getMessage() for r in caplog.records)
    assert steps_in(bucket) == [1, 2]
    assert steps_in(memory) == []  # the older copy freed, no new one


@pytest.mark.parametrize("in_background", [(), ("model", "optim")], ids=["staged-first", "staged-into-the-tier"])
def test_each_save_writes_its_data_files_into_the_memory_of_a_step_no_longer_needed(bucket, memory, in_background):
    model, opt = trained()
    inodes, spares = {}, {}
    with behind(bucket, memory) as store:
        for step in (1, 2, 3):
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step}, copy_in_background=in_background)
            assert store.flush().step == step
            [data] = step_dir(memory, step).glob("*.distcp")
            inodes[step] = data.stat().st_ino
            spare = memory / tier_files.SPARE_DIR / data.name
            spares[step] = (spare.stat().st_ino, spare.stat().st_size) if spare.exists() else None
        digest = model_digest(model.state_dict())
    # After the first save, the persister made a spare of its size in the background; the second save wrote into it.
    assert spares[1] == (inodes[2], (step_dir(bucket, 1) / data.name).stat().st_size)
    # Step 1 became the spare when step 2 committed; step 3 was written into its file, so the tier holds two copies.
    assert inodes[3] == inodes[1] != inodes[2]
    assert steps_in(memory) == [3] and (memory / tier_files.SPARE_DIR).is_dir()
    assert restored(bucket, memory) == (3, digest, "memory")


def test_a_save_says_where_its_time_went(bucket, memory):
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(
            1,
            app_state(model, opt),
            {"step": 1},
            model_digest=lambda staged: model_digest(staged["model"]),
            copy_in_background=("model", "optim"),
        )
        store.wait_copied()
        assert store.wait() is not None
        phases = store.metrics.last_save_phases
    assert list(phases) == ["staging", "writing", "model digest", "committing"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(store.metrics.last_save_seconds, abs=1e-3)


def test_no_spare_is_prepared_where_it_would_take_the_reserve_of_dev_shm(bucket, memory, monkeypatch):
    gate = GatedUploads(monkeypatch)
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait() is not None and gate.entered.wait(60)
        [data] = step_dir(memory, 1).glob("*.distcp")
        free = data.stat().st_size + memory_tier.RESERVE_BYTES - 1  # the spare would leave less than the reserve
        monkeypatch.setattr(
            memory_tier.shutil,
            "disk_usage",
            lambda _: memory_tier.shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free),
        )
        gate.release()
        assert store.flush().step == 1
    assert not list((memory / tier_files.SPARE_DIR).glob("*"))
    free += 1  # room for the spare and the reserve (not the real disk's: a full disk would fail the test)
    assert store.context.tier.prepare_spare({data.name: data.stat().st_size})
    assert (memory / tier_files.SPARE_DIR / data.name).stat().st_size == data.stat().st_size


def test_a_storage_interval_copies_every_nth_memory_checkpoint_and_flush_the_newest(bucket, memory):
    model, opt = trained()
    with CheckpointStore(
        bucket.as_uri(), keep=10, memory_tier=str(memory), persist_behind=True, persist_every_steps=3
    ) as store:
        for step in range(1, 9):
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait().step == step  # every one commits in memory
            store.wait_persisted()  # the copy of a due one is done before the next save (no newest-wins here)
        assert steps_in(bucket) == [1, 4, 7] and store.persist_lag_steps == 1
        assert steps_in(memory) == [8]  # the newest, held back; the older ones went as their successors committed
        assert store.flush().step == 8  # as SIGTERM and the end of the run do: the newest, whatever the interval
        digest = model_digest(model.state_dict())
    assert steps_in(bucket) == [1, 4, 7, 8] and store.metrics.superseded_persists == 0
    assert restored(bucket, None) == (8, digest, "storage")


def test_a_storage_interval_in_seconds_copies_the_first_memory_checkpoint_after_it_is_up(bucket, memory):
    model, opt = trained()
    now = [0.0]
    with CheckpointStore(
        bucket.as_uri(), keep=10, memory_tier=str(memory), persist_behind=True, persist_every_seconds=60
    ) as store:
        store.persister.clock = lambda: now[0]
        for step, at in ((1, 0.0), (2, 30.0), (3, 59.0), (4, 61.0), (5, 100.0)):
            now[0] = at
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait().step == step
            store.wait_persisted()
        assert steps_in(bucket) == [1, 4]  # 60 s after the copy of step 1 began: step 4; step 5 came 39 s after that
        assert store.flush().step == 5


def test_a_checkpoint_only_in_memory_is_never_taken_by_a_store_of_another_uri(tmp_path, memory, monkeypatch, caplog):
    """Two runs whose memory tiers share a name (uid-less runs of one name; a run's uid prevents it in a cluster):
    the second must not resume from the first one's checkpoint that only memory holds."""
    model, opt = trained()
    with behind(tmp_path / "first", memory) as store:
        monkeypatch.setattr(storage_module.Storage, "upload", lambda *_: (_ for _ in ()).throw(OSError("down")))
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait().step == 1 and store.flush() is None  # in memory only
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING), behind(tmp_path / "second", memory) as other:
        assert other.latest_valid() is None
    assert any("holds checkpoints of" in r.getMessage() for r in caplog.records)
    with behind(tmp_path / "first", memory) as again:  # the first run's restart still finds it
        assert again.latest_valid().step == 1


def test_a_memory_file_gone_between_finding_and_loading_is_read_from_storage(bucket, memory):
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.flush().step == 1
        digest = model_digest(model.state_dict())
    fresh, fresh_opt = trained(seed=99)
    state = app_state(fresh, fresh_opt)
    with behind(bucket, memory) as store:
        info = store.latest_valid()
        for path in data_files(step_dir(memory, 1)):
            path.unlink()  # /dev/shm cleared by someone else after the tier was looked at
        assert store.load(info, state) == {"step": 1}
        assert "storage" in store.metrics.last_restore_source
    fresh.load_state_dict(state["model"])
    assert model_digest(fresh.state_dict()) == digest


class _RecordingStorage:
    """The storage of `_spread_persister`: the manifests written, by step directory."""

    def __init__(self):
        self.manifests: dict[str, bytes] = {}

    def write_bytes(self, uri: str, data: bytes, atomic: bool = False) -> None:
        self.manifests[uri.rsplit("/", 1)[0]] = data


def _spread_persister(every_steps=None):
    """Rank 0's Persister of a run on three pods of one rank each, spread over them (no tier, no processes: the
    planning alone)."""
    from types import SimpleNamespace

    from trainingrun_trainer.checkpoint.context import StoreMetrics
    from trainingrun_trainer.checkpoint.persisting import Persister

    storage = _RecordingStorage()
    context = SimpleNamespace(
        persist_behind=True,
        ranks=SimpleNamespace(rank=0),
        nodes=["pod-0", "pod-1", "pod-2"],
        metrics=StoreMetrics(),
        storage=storage,
        trust=lambda info: None,
        in_storage=None,
    )
    rotation = SimpleNamespace(rotate_logging_errors=lambda: None)
    persister = Persister(context, rotation, every_steps=every_steps)
    persister.spread_over_pods([0, 1, 2])
    return persister, context, storage


def _checkpoint(step: int):
    from trainingrun_trainer.checkpoint import CheckpointInfo

    return CheckpointInfo(
        step=step, uri=f"file:///ckpt/step-{step:08d}", time="", size_bytes=0, valid=True, reason=None
    )


def _settled(persister) -> None:
    persister.wait_idle()  # the manifest plan_parts handed to the persister thread is written


def test_spread_over_pods_each_pod_copies_its_own_ranks_files():
    persister, _, _ = _spread_persister()
    names = [".metadata", "__0_0.distcp", "__0_replicated.distcp", "__1_0.distcp", "__2_0.distcp", "__2_1.distcp"]
    assert [name for name in names if persister._part_of(name)] == names[:3]  # rank 0's pod: the metadata too
    persister._context.ranks.rank = 2
    persister.spread_over_pods([0, 1, 2])
    assert [name for name in names if persister._part_of(name)] == ["__2_0.distcp", "__2_1.distcp"]


def test_spread_over_pods_storage_commits_once_every_pod_copied_its_part_and_a_newer_checkpoint_waits(caplog):
    """Rank 0 plans one checkpoint at a time; its manifest goes to storage at the first commit that finds every pod's
    part there; a checkpoint due while the pods still copy is held back and the next due supersedes it; a part that
    failed leaves the checkpoint out of storage, counted."""
    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    persister, context, storage = _spread_persister()
    assert persister.plan_parts(_checkpoint(10), b"m10", [None, None, None]).step == 10
    # Pod 1 still copies step 10: nothing is committed in storage, and step 15 waits.
    assert persister.plan_parts(_checkpoint(15), b"m15", [(10, True), None, (10, True)]) is None
    _settled(persister)
    assert storage.manifests == {}
    # Every part of 10 is there: its manifest; 15 is superseded by 20, which the pods copy next.
    assert persister.plan_parts(_checkpoint(20), b"m20", [(10, True)] * 3).step == 20
    _settled(persister)
    assert storage.manifests == {"file:///ckpt/step-00000010": b"m10"}
    assert context.in_storage.step == 10 and context.metrics.persists == 1
    assert context.metrics.superseded_persists == 1 and "step 15 is not persisted: step 20 supersedes it" in caplog.text
    # Pod 2 could not copy its part of 20: no manifest, a failed persist, and 25 is copied next.
    assert persister.plan_parts(_checkpoint(25), b"m25", [(20, True), (20, True), (20, False)]).step == 25
    _settled(persister)
    assert list(storage.manifests) == ["file:///ckpt/step-00000010"] and context.metrics.failed_persists == 1
    assert "step 20 (committed in memory) is not in storage: a pod could not copy its part" in caplog.text


def test_spread_over_pods_the_storage_interval_holds_back_and_a_flush_plans_the_one_held_back():
    persister, context, storage = _spread_persister(every_steps=10)
    assert persister.plan_parts(_checkpoint(10), b"m10", [None] * 3).step == 10
    assert persister.plan_parts(_checkpoint(15), b"m15", [(10, True)] * 3) is None  # before the interval
    assert persister.plan_parts(None, b"", [(10, True)] * 3) is None  # not flushing: nothing new planned
    assert persister.plan_parts(None, b"", [(10, True)] * 3, whenever=True).step == 15  # flushing
    assert persister.plan_parts(None, b"", [(15, True)] * 3, whenever=True) is None  # nothing left to plan
    _settled(persister)
    assert sorted(storage.manifests.values()) == [b"m10", b"m15"] and context.in_storage.step == 15
    assert context.metrics.superseded_persists == 0


def test_a_memory_checkpoint_that_lacks_a_file_its_rank_reads_is_passed_over_for_storages_saying_why(
    bucket, memory, monkeypatch, caplog
):
    """A pod's memory copy may hold only what its ranks read (a sharded state on more than two pods), so a copy that
    lacks a file is looked at; a rank that reads the missing file finds it not held, and the restart takes storage's
    newest, rank 0 saying that the newer one only memory held was passed over."""
    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.flush().step == 1
        storage_unreachable(monkeypatch)
        store.save(2, app_state(model, opt), {"step": 2})
        assert store.wait().step == 2
        store.flush()
    monkeypatch.undo()
    (step_dir(memory, 2) / "__0_0.distcp").unlink()  # what the only rank reads
    caplog.clear()
    with behind(bucket, memory) as store:
        assert store.latest_valid().step == 1
    assert (
        "checkpoint step 2, which only memory holds, is not in every pod's memory as its ranks read it" in caplog.text
    )


def _two_ranks_on_one_node_worker(rank: int, init_file: str, uri: str, tier: str, out_dir: str, entered, release):
    import json
    import shutil

    import torch
    import torch.distributed as dist
    from checkpoint_states import local_digest, wrapped

    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    full = [False]  # /dev/shm as a save finds it: without a byte free while set
    disk_usage = shutil.disk_usage
    memory_tier.shutil.disk_usage = lambda path: disk_usage(path)._replace(free=0) if full[0] else disk_usage(path)
    upload = storage_module.Storage.upload

    def held_in_the_first_copy(storage, path, target, *digest):
        if not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never released the copy"
        upload(storage, path, target, *digest)

    if rank == 0:
        storage_module.Storage.upload = held_in_the_first_copy  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = wrapped(0, sharded=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, seed=3)
        committed = local_digest(model)
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True) as store:
            store.save(1, app_state(model, opt))
            result = {"first": store.wait().step, "retires": store.context.tier.retires}
            if rank == 0:
                assert entered.wait(60), "rank 0 never began copying step 1 to storage"
            dist.barrier()  # rank 0's persister is inside its copy of step 1: now /dev/shm is full
            full[0] = True
            train_step(model, opt, seed=4)
            store.save(2, app_state(model, opt))
            result["second"] = store.wait().step  # no room: committed to storage directly
            full[0] = False
            train_step(model, opt, seed=5)
            store.save(3, app_state(model, opt))  # room again: into the memory of a step no longer needed
            result["third"] = store.wait().step
            dist.barrier()
            release.set()
            store.flush()
        dist.barrier()
        in_storage = {info.step: info for info in CheckpointStore(uri).list() if info.valid}
        result["in_storage"] = sorted(in_storage)
        if 1 in in_storage:
            fresh = wrapped(1, sharded=False)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            CheckpointStore(uri).load(in_storage[1], app_state(fresh, fresh_opt))
            result["same"] = local_digest(fresh) == committed
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_with_two_ranks_on_a_node_and_dev_shm_full_the_step_being_copied_reaches_storage_as_committed(tmp_path):
    """Issue 77 item 2. Rank 0 (the node's lead) copies step 1 to storage while /dev/shm is full for step 2. On main
    rank 1's `begin`, which held nothing, retired step 1 into the spare, step 3 was saved into its pages, and the copy
    of step 1 failed or read step 3's bytes under step 1's manifest. Only the lead retires now, by what it still copies,
    and the copy checks each file against the manifest as it streams."""

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    entered, release = context.Event(), context.Event()
    tier, uri = str(tmp_path / "shm" / "tier"), f"file://{tmp_path / 'bucket'}"
    results = spawned(
        _two_ranks_on_one_node_worker, 2, tmp_path, str(tmp_path / "pg"), uri, tier, str(tmp_path), entered, release
    )
    assert [r["retires"] for r in results] == [True, False]
    assert [(r["first"], r["second"], r["third"]) for r in results] == [(1, 2, 3)] * 2
    assert results[0]["in_storage"] == [1, 2, 3]
    assert [r["same"] for r in results] == [True, True]  # storage's step 1 is bitwise the state committed at step 1


@pytest.mark.parametrize("replaced", ["deleted", "replaced by another run's"])
def test_memory_from_before_the_storage_was_deleted_or_replaced_is_not_resumed(bucket, memory, caplog, replaced):
    """Issue 78 item 4: on main a rerun resumed a step node memory held although the user had deleted the checkpoint
    folder (the memory folder was named by run name and attempt only). A memory copy names the storage it belongs
    to by the token storage holds (`storage_identity`): a new folder has a new one. Memory ahead of the same storage
    is still resumed (test_a_restart_resumes_from_memory_what_storage_never_got)."""
    import shutil

    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait().step == 1
    assert steps_in(memory) == [1]
    shutil.rmtree(bucket)
    if replaced != "deleted":
        with CheckpointStore(bucket.as_uri()) as other:  # another script's checkpoint, older than the memory's
            other.save(0, app_state(*trained(seed=5)), {"step": 0}, blocking=True)
    with behind(bucket, memory) as store:  # the same script started again, on the same node
        newest = store.latest_valid()
        assert (newest.step if newest else None) == (None if replaced == "deleted" else 0)
    assert any("made before that storage was deleted or replaced" in r.getMessage() for r in caplog.records)


def test_a_tier_folder_of_another_user_is_never_read(bucket, memory):
    """/dev/shm is the machine's: a folder of the run's name that another user made is not this run's memory."""
    import os

    model, opt = trained()
    with behind(bucket, memory) as store:
        store.save(1, app_state(model, opt), {"step": 1})
        assert store.wait().step == 1
    try:
        os.chown(memory, 65534, 65534)
    except PermissionError:
        pytest.skip("changing a folder's owner needs root: this test runs as root in CI")
    with behind(bucket, memory) as store:
        info = store.latest_valid()
        store.load(info, app_state(*trained(seed=5)))
        assert store.metrics.last_restore_source == "storage" and store.context.tier.foreign
