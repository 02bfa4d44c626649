"""The memory tier (checkpoint/memory_tier.py) through CheckpointStore on file://: what a restart inside the pod
loads from node memory, and that a stale, partial or damaged copy is never used."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash
from checkpoint_states import app_state, flip_byte, make_model, step_dir, train_step, trained
from fsspec.implementations.local import LocalFileOpener

from trainingrun_trainer.checkpoint import (
    MANIFEST_NAME,
    CheckpointStore,
    manifest,
    memory_tier,
    model_digest,
    tier_files,
)
from trainingrun_trainer.checkpoint import storage as storage_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


RESERVE_SHARE = memory_tier.RESERVE_SHARE  # as shipped, before the `memory` fixture sets it aside


@pytest.fixture
def storage(tmp_path) -> Path:
    return tmp_path / "bucket"


@pytest.fixture
def memory(tmp_path, monkeypatch) -> Path:
    # The tier sits on the test machine's disk here, where a 10% reserve can be more than is free: these tests are not
    # about the reserve (test_without_room_for_a_reserve... is), so only RESERVE_BYTES stays.
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", 0.0)
    return tmp_path / "shm" / "trainingrun-uid-attempt-1"


def saved(storage: Path, memory: Path, steps=(5,)):
    """A model trained and saved at each of `steps` through a store with a memory tier; (model, digest of the last)."""
    model, opt = trained()
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory)) as store:
        for step in steps:
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait() is not None
    return model, model_digest(model.state_dict())


def restored(storage: Path, memory: Path | None):
    """A restarted process: a fresh model resumed from the newest checkpoint; (step, digest, where it read)."""
    model, opt = trained(seed=99)
    state = app_state(model, opt)
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory) if memory else None) as store:
        info = store.latest_valid()
        extra = store.load(info, state)
        model.load_state_dict(state["model"])
        return extra["step"], model_digest(model.state_dict()), store.metrics.last_restore_source


def data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name != MANIFEST_NAME and p.suffix != tier_files.DIGESTS_SUFFIX)


def digests_file(path: Path) -> Path:
    return path.with_name(path.name + tier_files.DIGESTS_SUFFIX)


def test_a_restart_loads_the_committed_checkpoint_from_memory_without_reading_its_data_from_storage(storage, memory):
    _, digest = saved(storage, memory)
    kept = step_dir(memory, 5)
    assert (kept / MANIFEST_NAME).read_bytes() == (step_dir(storage, 5) / MANIFEST_NAME).read_bytes()
    assert [p.name for p in data_files(kept)] == [p.name for p in data_files(step_dir(storage, 5))]
    assert restored(storage, None)[1:] == (digest, "storage")
    # Storage's data now differs from its manifest (same sizes): only a restore that never read it can be right.
    for path in data_files(step_dir(storage, 5)):
        flip_byte(path)
    assert restored(storage, memory) == (5, digest, "memory")


def test_only_the_newest_committed_checkpoint_is_kept(storage, memory):
    saved(storage, memory, steps=(5, 10, 15))
    assert sorted(p.name for p in memory.iterdir() if p.name != memory_tier.ORIGIN_NAME) == ["step-00000015"]


def test_a_newer_checkpoint_in_storage_than_in_memory_is_read_from_storage(storage, memory):
    saved(storage, memory, steps=(5,))
    _, newer = saved(storage, memory.parent / "another-pod", steps=(5, 10))  # committed by another pod
    assert restored(storage, memory) == (10, newer, "storage")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def rewrite_digests(path: Path, change) -> None:
    digests = json.loads(digests_file(path).read_text())
    change(digests)
    digests_file(path).write_text(json.dumps(digests))


@pytest.mark.parametrize(
    "damage, source",
    [
        (lambda kept: (kept / MANIFEST_NAME).unlink(), "storage"),  # killed before the commit reached memory
        (
            lambda kept: (kept / MANIFEST_NAME).write_text((kept / MANIFEST_NAME).read_text().replace("5", "6", 1)),
            "storage",
        ),  # another manifest
        (lambda kept: truncate(data_files(kept)[-1]), "storage"),
        (lambda kept: data_files(kept)[0].unlink(), "storage"),
        (
            lambda kept: digests_file(data_files(kept)[-1]).unlink(),
            "storage",
        ),  # killed between the file and its digests
        (
            lambda kept: rewrite_digests(data_files(kept)[-1], lambda d: d.update(file_digest=["xxh3_128", "0" * 32])),
            "storage",
        ),  # stale
        # Same size, other bytes: found as it loads, the load reads it again from storage.
        (lambda kept: flip_byte(data_files(kept)[-1]), "memory and storage"),
        (
            lambda kept: rewrite_digests(data_files(kept)[-1], lambda d: d["xxh3_128"].__setitem__(-1, "0" * 32)),
            "memory and storage",
        ),
    ],
    ids=[
        "no-manifest",
        "other-manifest",
        "truncated",
        "missing-file",
        "no-digests",
        "stale-digests",
        "flipped-byte",
        "wrong-segment-digest",
    ],
)
def test_a_partial_or_damaged_copy_is_never_used(storage, memory, damage, source):
    _, digest = saved(storage, memory)
    damage(step_dir(memory, 5))
    assert restored(storage, memory) == (5, digest, source)
    # What the restore read from storage to verify it replaced the damaged copy: the next restart reads memory.
    assert restored(storage, memory) == (5, digest, "memory")


def test_when_storage_is_damaged_too_the_load_fails_and_a_restart_resumes_from_the_checkpoint_before(storage, memory):
    model, opt = trained()
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory), keep=2) as store:
        for step in (5, 10):
            train_step(model, opt, seed=step)
            store.save(step, app_state(model, opt), {"step": step})
            assert store.wait() is not None
            if step == 5:
                older = model_digest(model.state_dict())
    for directory in (step_dir(memory, 10), step_dir(storage, 10)):
        flip_byte(data_files(directory)[-1])
    with pytest.raises(
        OSError,
        match=r"its copy in memory is damaged and storage is not readable or not valid "
        r"\(xxh3_128 mismatch in __0_0.distcp\); a restart resumes",
    ):
        restored(storage, memory)
    assert restored(storage, memory) == (5, older, "storage")


def test_a_new_pods_restore_downloads_each_file_once_and_keeps_it_for_the_next_restart(storage, memory, monkeypatch):
    _, digest = saved(storage, memory.parent / "the-pod-before")
    opened = []
    real_open = LocalFileOpener.__init__

    def counting(self, path, mode, *args, **kwargs):
        if "r" in mode and str(path).endswith(".distcp"):
            opened.append(Path(path).name)
        real_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(LocalFileOpener, "__init__", counting)
    open_regular = storage_module._open_regular  # how the store itself reads a local file

    def counted(path):
        if str(path).endswith(".distcp"):
            opened.append(Path(path).name)
        return open_regular(path)

    monkeypatch.setattr(storage_module, "_open_regular", counted)
    assert restored(storage, memory) == (5, digest, "storage")  # a new pod: its memory was empty
    assert sorted(opened) == sorted(p.name for p in data_files(step_dir(storage, 5)) if p.suffix == ".distcp")
    opened.clear()
    assert restored(storage, memory) == (5, digest, "memory") and opened == []


def test_a_new_pods_restore_checks_the_files_of_a_checkpoint_at_once(storage, memory, monkeypatch):
    """Rank 0 of a new pod reads, hashes and keeps in memory every file of every rank before any rank loads: one at a
    time, each file waited for the one before it."""
    _, digest = saved(storage, memory.parent / "the-pod-before")
    monkeypatch.setattr(manifest, "CHECK_THREADS", 2)
    together = threading.Barrier(2, timeout=30)  # broken unless two files are checked at the same time
    real_check = manifest._check

    checked = []

    def check(storage, uri, entry, *args):
        checked.append(entry["path"])
        together.wait()
        return real_check(storage, uri, entry, *args)

    monkeypatch.setattr(manifest, "_check", check)
    assert restored(storage, memory) == (5, digest, "storage")
    assert len(checked) >= 2
    monkeypatch.setattr(manifest, "_check", real_check)
    assert restored(storage, memory) == (5, digest, "memory")  # every copy it kept is whole


@pytest.fixture
def hashed(monkeypatch) -> list:
    """The tier files whose segments a load hashed."""
    paths: list = []
    real = tier_files.VerifiedTierFile._hash_read

    def counting(self, *args):
        paths.append(Path(self._file.path).name)
        return real(self, *args)

    monkeypatch.setattr(tier_files.VerifiedTierFile, "_hash_read", counting)
    return paths


def test_a_new_pods_restore_hashes_what_it_downloads_once(storage, memory, hashed):
    """Rank 0 of a new pod verifies each file while it downloads it into the tier: the load that follows in that
    process reads those bytes without hashing them again; a restart (another process) checks every segment."""
    _, digest = saved(storage, memory.parent / "the-pod-before")
    assert restored(storage, memory) == (5, digest, "storage")
    assert hashed == []
    assert restored(storage, memory) == (5, digest, "memory") and "__0_0.distcp" in hashed


def test_a_file_changed_after_its_download_is_checked_as_it_loads(storage, memory, hashed, monkeypatch):
    _, digest = saved(storage, memory.parent / "the-pod-before")
    real_forget = memory_tier.MemoryTier.forget

    def damage_then_forget(self):  # between the download (latest_valid) and the load
        flip_byte(data_files(step_dir(memory, 5))[-1])
        real_forget(self)

    monkeypatch.setattr(memory_tier.MemoryTier, "forget", damage_then_forget)
    # Found as it loaded (the weights are the saved ones), and read again from storage.
    assert restored(storage, memory) == (5, digest, "storage")
    assert "__0_0.distcp" in hashed


def rewrite_manifests(storage: Path, memory: Path, step: int, change) -> None:
    """Apply `change` to every file entry of the committed manifest, in storage and in memory alike (so the copy
    stays byte for byte the committed one)."""
    manifest = json.loads((step_dir(storage, step) / MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        change(entry)
    for directory in (step_dir(storage, step), step_dir(memory, step)):
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_each_copy_has_its_file_digest_and_the_xxh3_of_each_segment_beside_it(storage, memory, monkeypatch):
    monkeypatch.setattr(tier_files, "SEGMENT_BYTES", 4096)  # several segments of a small model's files
    _, digest = saved(storage, memory)
    manifest = {e["path"]: e for e in json.loads((step_dir(storage, 5) / MANIFEST_NAME).read_text())["files"]}
    for path in data_files(step_dir(memory, 5)):
        data = path.read_bytes()
        assert json.loads(digests_file(path).read_text()) == {
            "size": len(data),
            "file_digest": ["xxh3_128", manifest[path.name]["xxh3_128"]],
            "segment_bytes": 4096,
            "xxh3_128": [xxhash.xxh3_128(data[at : at + 4096]).hexdigest() for at in range(0, len(data), 4096)],
        }
    assert restored(storage, memory) == (5, digest, "memory")


@pytest.mark.parametrize("with_tier", [False, True])
def test_the_manifest_lists_path_size_and_xxh3_128_only(storage, memory, with_tier):
    model, opt = trained()
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory) if with_tier else None) as store:
        store.save(5, app_state(model, opt), {"step": 5})
        assert store.wait() is not None
    entries = json.loads((step_dir(storage, 5) / MANIFEST_NAME).read_text())["files"]
    assert entries and all(set(entry) == {"path", "size", "xxh3_128"} for entry in entries)


def test_a_failed_save_keeps_nothing_of_its_step_and_the_committed_copy_stays(storage, memory, monkeypatch):
    model, digest = saved(storage, memory, steps=(5,))
    monkeypatch.setattr(
        "trainingrun_trainer.checkpoint.committing.Committer._commit",
        lambda self, job, uri, statuses: (None, "rank 0: refused", b""),
    )
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory)) as store:
        store.save(10, app_state(model, torch.optim.AdamW(model.parameters())), {"step": 10})
        assert store.wait() is None
    assert sorted(p.name for p in memory.iterdir() if p.name != memory_tier.ORIGIN_NAME) == ["step-00000005"]
    monkeypatch.undo()
    assert restored(storage, memory) == (5, digest, "memory")


def test_a_tier_that_cannot_be_written_turns_off_with_one_warning_and_saves_go_on(storage, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="trainingrun.checkpoint"):
        _, digest = saved(storage, blocked / "tier", steps=(5, 10))
    warnings = [r for r in caplog.records if "no longer kept in memory" in r.getMessage()]
    assert len(warnings) == 1
    assert restored(storage, blocked / "tier") == (10, digest, "storage")


def test_without_room_for_a_reserve_the_copy_is_skipped_and_the_older_one_freed(storage, memory, monkeypatch, caplog):
    saved(storage, memory, steps=(5,))
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", RESERVE_SHARE)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(memory_tier.shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - (70 << 20), 70 << 20))
    with caplog.at_level(logging.WARNING, logger="trainingrun.checkpoint"):
        _, digest = saved(storage, memory, steps=(10, 15))
    assert sum("not kept in memory" in r.getMessage() for r in caplog.records) == 1
    assert not step_dir(memory, 5).exists() and not (step_dir(memory, 15) / MANIFEST_NAME).exists()
    monkeypatch.undo()
    assert restored(storage, memory) == (15, digest, "storage")


class FullDisk:
    """A tier file on a full /dev/shm."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.real.close()


def test_a_copy_that_fails_mid_write_drops_only_the_copy(storage, memory, monkeypatch, caplog):
    real_init = memory_tier.TierCopy.__init__

    def on_a_full_disk(self, tier, path):
        real_init(self, tier, path)
        if self.file is not None and path.endswith(".distcp"):
            self.file = FullDisk(self.file)

    monkeypatch.setattr(memory_tier.TierCopy, "__init__", on_a_full_disk)
    with caplog.at_level(logging.WARNING, logger="trainingrun.checkpoint"):
        _, digest = saved(storage, memory)
    assert any("No space left on device" in r.getMessage() for r in caplog.records)
    assert not step_dir(memory, 5).exists()  # the part written is freed: a full /dev/shm fails DataLoader workers
    assert restored(storage, memory) == (5, digest, "storage")


class _Unwrapped(torch.nn.Module):
    """A model under `module`, as DDP holds it, that no collective keeps equal to the other ranks'."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _two_rank_worker(
    rank: int,
    world: int,
    init_file: str,
    uri: str,
    tiers: list[str],
    out_dir: str,
    damage: bool = False,
    persist_behind: bool = False,
    replicas_differ: bool = False,
    room: bool = True,
) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    memory_tier.RESERVE_SHARE = 0.0  # as the `memory` fixture does, in this process
    if not room:  # the pods' memory has room for their own ranks' files (tier.begin), not for the other pod's
        from trainingrun_trainer.checkpoint import mirroring

        mirroring.reserve_bytes = lambda total: 1 << 60
    torch.set_num_threads(1)
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainingrun.checkpoint").addHandler(handler)
    os.environ["TRAININGRUN_POD_NAME"] = f"pod-{rank}"  # as the downward API names each pod
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Replicas that are not bitwise equal: the same names, each rank's own values (no DDP to make them equal).
        ddp = DDP(make_model(0)) if not replicas_differ else _Unwrapped(make_model(rank))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        train_step(ddp, opt, seed=100 + rank)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=persist_behind) as store:
            store.save(5, app_state(ddp, opt), {"rank": rank})
            assert store.wait() is not None
            behind, short = store.persist_behind, store.memory_short
        # closed: persisted (every rank's files, by rank 0 when they share a node)
        assert [info.step for info in CheckpointStore(uri).list(verify=True) if info.valid] == [5]
        if damage:  # the largest file of the node's copy, whichever rank's share it is in
            if rank == 0:
                flip_byte(max(data_files(step_dir(Path(tiers[0]), 5)), key=lambda p: p.stat().st_size))
            dist.barrier()
        # The worker group restarted in place: new processes, the same node memory.
        fresh = DDP(make_model(1)) if not replicas_differ else _Unwrapped(make_model(1))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = app_state(fresh, fresh_opt)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=persist_behind) as store:
            extra = store.load(store.latest_valid(), state)
            source, read = store.metrics.last_restore_source, store.metrics.last_restore_bytes
        (fresh.module if isinstance(fresh, DDP) else fresh).load_state_dict(state["model"])
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": extra["rank"],
                    "source": source,
                    "bytes": read,
                    "digest": model_digest(fresh.module.state_dict()),
                    "behind": behind,
                    "short": short,
                    "warned": warned,
                    "kept": sorted(p.name for p in data_files(step_dir(Path(tiers[rank]), 5))),
                    "stored": sorted(p.name for p in data_files(step_dir(Path(uri.removeprefix("file://")), 5))),
                    "expected": model_digest(ddp.module.state_dict()),
                }
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_two_ranks_restore_from_their_nodes_memory(tmp_path, nodes):
    """One node: both ranks' files are in its memory. Two nodes: DCP spreads the replicated tensors over both ranks'
    files, and each node's lowest rank also writes the file the other node's rank wrote, from its own replica
    (`mirroring`): each node's memory holds the whole checkpoint, and a restart on either reads nothing from
    storage."""
    sources = ["memory", "memory"]
    tiers = [str(tmp_path / f"node-{rank * nodes // 2}" / "tier") for rank in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(
        _two_rank_worker,
        args=(2, str(tmp_path / "pg-store"), uri, tiers, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["source"] for r in results] == sources
    assert [r["rank"] for r in results] == [0, 1]
    # The bytes by where they came from, as trainingrun_checkpoint_restore_bytes_total exports them.
    by_source = [(r["bytes"]["own_memory"] > 0, r["bytes"]["storage"] > 0) for r in results]
    assert by_source == [(True, False), (True, False)]
    assert results[0]["kept"] == results[1]["kept"] == results[0]["stored"]  # every file in each node's memory
    assert [r["short"] for r in results] == [None, None]  # no pod ever lacked room: nothing for status to say
    assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_two_ranks_persist_behind_on_one_node_and_on_two(tmp_path, nodes):
    """Persisting behind needs every file in rank 0's node's tier (rank 0 copies them all): on one node every rank's
    are there, on two each node's lowest rank writes the other node's too (`mirroring`), and the save commits in
    memory once every node holds every file."""
    sources, behind = ["memory", "memory"], True
    tiers = [str(tmp_path / f"node-{rank * nodes // 2}" / "tier") for rank in range(2)]
    mp.spawn(
        _two_rank_worker,
        args=(2, str(tmp_path / "pg-store"), f"file://{tmp_path / 'ckpt'}", tiers, str(tmp_path), False, True),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["behind"] for r in results] == [behind, behind]
    assert [r["source"] for r in results] == sources
    assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]


@pytest.mark.slow
def test_a_damaged_file_found_as_two_ranks_load_is_read_again_from_storage_by_both(tmp_path):
    tiers = [str(tmp_path / "node" / "tier")] * 2
    mp.spawn(
        _two_rank_worker,
        args=(2, str(tmp_path / "pg-store"), f"file://{tmp_path / 'ckpt'}", tiers, str(tmp_path), True),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["source"] for r in results] == ["memory and storage"] * 2
    assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]


@pytest.mark.parametrize("from_memory", [True, False])
def test_a_large_file_is_read_by_several_threads(storage, memory, monkeypatch, from_memory):
    from trainingrun_trainer.checkpoint import tensor_files

    monkeypatch.setattr(tensor_files, "READ_THREADS", 3)
    monkeypatch.setattr(tensor_files, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(tier_files, "SEGMENT_BYTES", 4096)  # the parts start and end inside segments
    _, digest = saved(storage, memory)
    opened = []
    real_create = tier_files.LocalFirstFileSystem.create_stream

    def create_stream(self, path, mode):
        opened.append(Path(path).name)
        return real_create(self, path, mode)

    monkeypatch.setattr(tier_files.LocalFirstFileSystem, "create_stream", create_stream)
    source = "memory" if from_memory else "storage"
    assert restored(storage, memory if from_memory else None) == (5, digest, source)
    assert opened.count("__0_0.distcp") == 4  # three parts of its tensors, then DCP's read of the byte items
    if from_memory:
        flip_byte(data_files(step_dir(memory, 5))[-1])
        assert restored(storage, memory) == (5, digest, "memory and storage")


def test_a_restart_asks_storage_for_its_listing_and_for_the_step_in_memory_at_once(storage, memory, monkeypatch):
    """On an object store each request is a round trip: the base listing, the listing of the step the tier holds and
    its manifest go out together, so a restart from memory waits for one round trip, not three."""
    from trainingrun_trainer.checkpoint.storage import STORAGE_ID_NAME, Storage

    _, digest = saved(storage, memory)
    real_init = Storage.__init__

    def as_an_object_store(self, *args, **kwargs):  # file:// storage is read one request after another
        real_init(self, *args, **kwargs)
        self.local = False

    monkeypatch.setattr(Storage, "__init__", as_an_object_store)
    together = threading.Barrier(3, timeout=30)
    real_listing, real_read = Storage.listing, Storage.read_bytes

    def waiting(real):
        def call(self, uri, **options):
            # The store's own name of its storage is read once, as the store starts, before any restart begins.
            if not passed and not together.broken and not uri.endswith(STORAGE_ID_NAME):
                if together.wait() == 0:
                    passed.append(True)
            return real(self, uri, **options)

        return call

    passed: list = []
    monkeypatch.setattr(Storage, "listing", waiting(real_listing))
    monkeypatch.setattr(Storage, "read_bytes", waiting(real_read))
    assert restored(storage, memory) == (5, digest, "memory")
    assert passed and not together.broken


def restored_bytes(storage: Path, memory: Path | None) -> dict:
    """A restarted process's restore: the bytes it read by source (`StoreMetrics.last_restore_bytes`)."""
    model, opt = trained(seed=98)
    state = app_state(model, opt)
    with CheckpointStore(storage.as_uri(), memory_tier=str(memory) if memory else None) as store:
        store.load(store.latest_valid(), state)
        assert store.metrics.restore_bytes == store.metrics.last_restore_bytes  # one restore: the totals are it
        return store.metrics.last_restore_bytes


def test_a_restore_counts_its_bytes_by_where_they_came_from(storage, memory):
    model, _ = saved(storage, memory)
    tensors = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    from_memory = restored_bytes(storage, memory)
    assert from_memory[tier_files.STORAGE] == 0 and from_memory[tier_files.OWN_MEMORY] > 2 * tensors  # + AdamW's
    new_pod = restored_bytes(storage, memory.parent / "a-new-pod")  # downloaded into its memory, then read: storage's
    assert new_pod == {
        tier_files.OWN_MEMORY: 0,
        tier_files.PEER: 0,
        tier_files.STORAGE: from_memory[tier_files.OWN_MEMORY],
    }
    assert restored_bytes(storage, None) == new_pod


@pytest.mark.slow
def test_what_a_process_killed_while_preparing_the_spare_left_is_removed_at_the_next_ones_first_use(
    storage, memory, caplog
):
    """Issue 77 item 4: a process SIGKILLed inside `prepare_spare` (here by its own fallocate, once the half-made spare
    holds a file) leaves `.spare.<id>.partial` at full size; on main every in-place restart after such a kill leaked
    it for good. The next process's first use of the tier removes it and says how much."""
    import subprocess
    import sys

    saved(storage, memory)
    code = f"""
import os, signal
from trainingrun_trainer.checkpoint import memory_tier
real = os.posix_fallocate
def killed_after(fd, offset, size):
    real(fd, offset, size)
    os.kill(os.getpid(), signal.SIGKILL)
os.posix_fallocate = killed_after
memory_tier.RESERVE_SHARE = 0.0
tier = memory_tier.MemoryTier({str(memory)!r}, recycle=True)
tier.prepare_spare({{"__0_0.distcp": 3 << 20, "__1_0.distcp": 3 << 20}})
"""
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    left = [p for p in memory.iterdir() if p.name.endswith(".partial")]
    assert len(left) == 1 and sum(f.stat().st_size for f in left[0].iterdir()) == 3 << 20
    with caplog.at_level(logging.INFO, logger="trainingrun.checkpoint"):
        restored(storage, memory)  # the restart: its restore is the tier's first use
    assert not [p for p in memory.iterdir() if p.name.endswith(".partial")]
    assert any(
        "removed 1 leftover(s) of an earlier process" in r.getMessage() and "(3 MiB" in r.getMessage()
        for r in caplog.records
    )
