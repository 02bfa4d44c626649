"""mirroring.NodeMirror: with several nodes each node's lowest rank writes the other nodes' files into its memory from
its own replica; a copy is kept only when it is its writer's file byte for byte, and a node that cannot hold every file
turns committing in memory off. A sharded state on three pods keeps each pod's own files, its neighbour's and the
replicated items there, which a restart in place reads (`restoring`); it commits in memory, and each pod copies its
own ranks' files to storage (`persisting`, spread over the pods)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, local_digest, step_dir, train_step, wrapped
from test_checkpoint_memory_tier import _two_rank_worker

from trainingrun_trainer.checkpoint import CheckpointStore, memory_tier, mirroring
from trainingrun_trainer.checkpoint import storage as storage_module


@pytest.mark.slow
@pytest.mark.parametrize("replicas_differ, room", [(True, True), (False, False)], ids=["replicas differ", "no room"])
def test_a_copy_of_the_other_pods_file_that_differs_or_finds_no_room_is_left_out(tmp_path, replicas_differ, room):
    """A node's copy of a file is kept only when it is the file its writer wrote, byte for byte (by its xxh3_128):
    replicas that are not equal give other bytes, and the copy is left out; so is every copy when the pod's memory
    lacks room for them. A restart then reads those files from storage, and loads what was committed."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(
        _two_rank_worker,
        args=(2, str(tmp_path / "pg-store"), uri, tiers, str(tmp_path), False, False, replicas_differ, room),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Node 1 kept its own rank's file only (node 0's rank 0 keeps what it verified in storage for the restart).
    assert results[1]["kept"] != results[1]["stored"] and results[1]["kept"], results[1]
    assert all(result["bytes"]["storage"] > 0 for result in results)
    said = "its bytes differ from the file the other pod wrote" if replicas_differ else "not enough for the"
    assert [any(said in w for w in result["warned"]) for result in results] == [True, True], results
    if not replicas_differ:
        assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]
    # For status.checkpointMemoryShort (condition CheckpointMemoryShort), on rank 0: the pods that lacked room.
    assert results[0]["short"] == (None if replicas_differ else [5, ["pod-0", "pod-1"]])


def _behind_without_room_worker(
    rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str, sharded: bool
) -> None:
    from trainingrun_trainer.checkpoint import mirroring

    memory_tier.RESERVE_SHARE = 0.0
    mirroring.reserve_bytes = lambda total: (
        1 << 60
    )  # room for each rank's own files (tier.begin), not for the other node's
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ddp = wrapped(0, sharded)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            behind = [store.persist_behind]
            outcomes = []
            for step in (5, 10):
                train_step(ddp, opt, seed=step)
                store.save(step, app_state(ddp, opt), {"rank": rank})
                info = store.wait()
                outcomes.append(None if info is None else info.uri)
                behind.append(store.persist_behind)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"outcomes": outcomes, "behind": behind}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["DDP", "FSDP2"])
def test_a_node_that_cannot_hold_every_file_turns_persisting_behind_off_and_saves_go_to_storage(tmp_path, sharded):
    """A checkpoint a restart on some node could not load from its memory is not committed there: that save fails,
    and from then on saves commit to storage (each node keeping the copies it can). FSDP2: each pod tells the one
    sending it shards that it has no room, so neither waits for the other."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(
        _behind_without_room_worker,
        args=(str(tmp_path / "pg"), uri, tiers, str(tmp_path), sharded),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["behind"] == [True, False, False]
        assert result["outcomes"] == [None, f"{uri}/step-00000010"]
    assert [info.step for info in CheckpointStore(uri).list() if info.valid] == [10]


def chunks(items, tensors):
    written = mirroring._WrittenFile("node-0", "__0_0.distcp", 0, "", tuple(items))
    return list(mirroring.NodeMirror._chunks(written, tensors))


def test_a_file_is_built_item_by_item_in_file_order_from_the_nodes_tensors_and_the_bytes_sent():
    weight = torch.arange(4, dtype=torch.float32)
    built = chunks(
        [mirroring._Item("optim.lr", 0, 3, b"abc"), mirroring._Item("model.w", 3, 16, None)], {"model.w": weight}
    )
    assert b"".join(bytes(c) for c in built) == b"abc" + weight.numpy().tobytes()


def test_a_staged_files_alignment_padding_is_built_as_the_zeros_it_holds():
    weight = torch.arange(4, dtype=torch.float32)
    built = chunks(
        [mirroring._Item("model.w", 0, 16, None), mirroring._Item("optim.lr", 64, 3, b"abc")], {"model.w": weight}
    )
    assert b"".join(bytes(c) for c in built) == weight.numpy().tobytes() + bytes(48) + b"abc"


@pytest.mark.parametrize(
    "items, tensors, why",
    [
        ([mirroring._Item("model.w", 64, 16, None)], {"model.w": torch.zeros(4)}, "a gap at byte 0"),
        ([mirroring._Item("model.w", 0, 16, None)], {}, "this pod holds no model.w"),
        ([mirroring._Item("model.w", 0, 16, None)], {"model.w": torch.zeros(2)}, "model.w has 8 bytes here, 16 there"),
    ],
)
def test_a_file_this_node_cannot_build_says_why(items, tensors, why):
    assert chunks(items, tensors)[-1] == why


class _Sharded(torch.Tensor):
    """Stands in for a DTensor (FSDP2's): what `check_state` looks for is its placements."""

    placements = ("Shard(0)",)


@pytest.mark.parametrize("pods", [2, 3])
def test_a_sharded_state_is_copied_in_a_ring_and_keeps_its_replicated_items_apart_on_more_than_two_pods(caplog, pods):
    import logging
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    context = SimpleNamespace(
        tier=object(), nodes=[f"pod-{n}" for n in range(pods)], ranks=SimpleNamespace(rank=0), persist_behind=True
    )
    replicated = mirroring.NodeMirror(context)
    replicated.check_state({"model": {"w": torch.zeros(2)}})
    assert replicated.rebuilds and context.persist_behind  # DDP: each pod rebuilds the others' files
    mirror = mirroring.NodeMirror(context)
    mirror.check_state({"model": {"w": torch.zeros(2).as_subclass(_Sharded)}})
    assert mirror.active and mirror.writes and mirror.sharded and not mirror.rebuilds
    assert context.persist_behind  # committing in memory stays on: on three pods persisting is spread over them
    assert mirror.keeps_replicated_apart == (pods > 2)
    assert ("each pod copies its own ranks' files to storage" in caplog.text) == (pods > 2)


def _ring_worker(rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str, lacking: bool) -> None:
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    uploaded: list[str] = []  # the files this pod's lead copied to storage
    upload = storage_module.Storage.upload

    def recording(storage, path: str, uri: str, *digest: str) -> None:
        uploaded.append(uri.rsplit("/", 1)[1])
        upload(storage, path, uri, *digest)

    storage_module.Storage.upload = recording  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=len(tiers))
    try:
        model = wrapped(0, sharded=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, seed=3)
        saved = local_digest(model)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            store.save(5, app_state(model, opt), {"rank": rank})
            info = store.wait()
            held = sorted(p.name for p in step_dir(Path(tiers[rank]), 5).iterdir() if not p.name.endswith(".xxh3"))
            result = {"committed": None if info is None else info.uri, "behind": store.persist_behind, "held": held}
            result["in_storage"] = getattr(store.flush(), "step", None)
        result["uploaded"] = sorted(uploaded)
        dist.barrier()
        if lacking and rank == 1:  # this pod's copy of its own rank's shards is gone
            (step_dir(Path(tiers[rank]), 5) / "__1_0.distcp").unlink()
        dist.barrier()
        # Restarted in place: every pod's memory is as the save left it.
        model = wrapped(1, sharded=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, seed=4)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            info = store.latest_valid()
            extra = store.load(info, app_state(model, opt))
            result.update(
                restored=info.step,
                extra=extra,
                same=local_digest(model) == saved,
                read=store.metrics.last_restore_bytes,
            )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lacking", [False, True], ids=["in place", "a pod lacks its own file"])
def test_on_three_pods_each_keeps_its_own_shards_its_neighbours_and_the_replicated_items_and_restores_from_them(
    tmp_path, lacking
):
    """Three nodes of one rank each, FSDP2: every pod's memory holds its rank's file, the previous pod's (sent in the
    ring, an odd one: the ordering that lets every send meet its receive), the metadata and rank 0's replicated items
    (which DCP would have spread over every rank's file), never the next pod's own file. No pod holds every file: the
    save commits in memory, and each pod copies only the files its own rank wrote to storage (rank 0 also the metadata
    and the replicated items), rank 0 writing the manifest once every part is there. A restart in place then reads every byte from its own pod's memory, on every rank,
    rank 0 included: nothing is downloaded to verify it. A pod that lacks its own file receives it from the next pod,
    which holds it through the ring; each rank gets back its own shards bitwise either way."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(3)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(_ring_worker, args=(str(tmp_path / "pg"), uri, tiers, str(tmp_path), lacking), nprocs=3, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["committed"] for r in results] == [f"{uri}/step-00000005"] * 3
    assert [r["behind"] for r in results] == [True] * 3
    assert [r["in_storage"] for r in results] == [5] * 3  # the flush at the end waits for every part and the manifest
    for rank, result in enumerate(results):
        previous = (rank - 1) % 3
        own = {".metadata", "manifest.json", "__0_replicated.distcp", f"__{rank}_0.distcp"}
        assert result["held"] == sorted(own | {f"__{previous}_0.distcp"})
    assert [r["uploaded"] for r in results] == [
        [".metadata", "__0_0.distcp", "__0_replicated.distcp"],
        ["__1_0.distcp"],
        ["__2_0.distcp"],
    ]
    assert [info.step for info in CheckpointStore(uri).list() if info.valid] == [5]
    assert [(r["restored"], r["extra"], r["same"]) for r in results] == [(5, {"rank": rank}, True) for rank in range(3)]
    assert [r["read"]["storage"] for r in results] == [0, 0, 0]
    if not lacking:
        assert all(r["read"]["own_memory"] > 0 for r in results)
    else:  # pod 2 holds pod 1's file too (the ring): pod 1 receives it from there (`peers`)
        assert results[1]["read"]["peer"] > 0 and results[2]["read"]["peer"] == 0


def test_one_node_copies_nothing():
    from types import SimpleNamespace

    context = SimpleNamespace(
        tier=object(), nodes=["pod-a", "pod-a"], ranks=SimpleNamespace(rank=1), persist_behind=True
    )
    mirror = mirroring.NodeMirror(context)
    assert not mirror.active and not mirror.writes


def _saves_by_the_last_plan_worker(rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str) -> None:
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    tier = tiers[rank // 2]  # ranks 0 and 1 on node 0, 2 and 3 on node 1
    try:
        model = wrapped(0, sharded=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        committed = []
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True, persist_every_steps=1000) as store:
            for step in range(1, 5):
                train_step(model, opt, seed=step)
                store.save(step, app_state(model, opt), {"rank": rank}, copy_in_background=("model", "optim"))
                info = store.wait()
                committed.append(info is not None and store.persist_behind)
            staged = store.committer.pods.mirror.staged_copies_kept
        fresh = wrapped(1, sharded=False)
        state = app_state(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True) as store:  # restarted in place
            found = store.latest_valid()
            store.load(found, state)
            read = store.metrics.last_restore_bytes
        fresh.module.load_state_dict(state["model"])
        result = {
            "committed": committed,
            "staged": staged,
            "step": found.step,
            "read": read,
            "digest": local_digest(fresh),
            "expected": local_digest(model),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_saves_by_the_last_plan_stage_the_other_pods_files_straight_into_the_copies(tmp_path):
    """Two nodes of two ranks, DDP. From the third save (the first is planned by DCP and written whole, the second
    lays each rank's file out as its staged file), each node's lowest rank stages the other node's two files where
    their ranks stage them, and only appends the byte items it is sent and hashes: every save commits in memory, and
    a restart in place restores the last from each node's own memory, no byte from storage, bitwise."""
    tiers = [str(tmp_path / f"node-{node}" / "tier") for node in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(
        _saves_by_the_last_plan_worker, args=(str(tmp_path / "pg"), uri, tiers, str(tmp_path)), nprocs=4, join=True
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["committed"] for r in results] == [[True] * 4] * 4
    assert [r["staged"] for r in results] == [4, 0, 4, 0]  # saves 3 and 4, the other node's two files each
    assert [r["step"] for r in results] == [4] * 4
    assert [r["read"]["storage"] for r in results] == [0] * 4
    assert all(r["read"]["own_memory"] > 0 for r in results)
    assert [r["digest"] for r in results] == [results[0]["expected"]] * 4
