"""mirroring.NodeMirror: with several nodes each node's lowest rank writes the other nodes' files into its memory from
its own replica; a copy is kept only when it is its writer's file byte for byte, and a node that cannot hold every file
turns committing in memory off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, make_model, train_step
from test_checkpoint_memory_tier import _two_rank_worker

from trainingrun_trainer.checkpoint import CheckpointStore, memory_tier, mirroring


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


def _behind_without_room_worker(rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainingrun_trainer.checkpoint import mirroring

    memory_tier.RESERVE_SHARE = 0.0
    mirroring.RESERVE_BYTES = 1 << 60  # room for each rank's own files (tier.begin), not for the other node's
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ddp = DDP(make_model(0))
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
def test_a_node_that_cannot_hold_every_file_turns_persisting_behind_off_and_saves_go_to_storage(tmp_path):
    """A checkpoint a restart on some node could not load from its memory is not committed there: that save fails,
    and from then on saves commit to storage (each node keeping the copies it can)."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(_behind_without_room_worker, args=(str(tmp_path / "pg"), uri, tiers, str(tmp_path)), nprocs=2, join=True)
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


@pytest.mark.parametrize(
    "items, tensors, why",
    [
        ([mirroring._Item("model.w", 4, 16, None)], {"model.w": torch.zeros(4)}, "a gap at byte 0"),
        ([mirroring._Item("model.w", 0, 16, None)], {}, "this pod holds no model.w"),
        ([mirroring._Item("model.w", 0, 16, None)], {"model.w": torch.zeros(2)}, "model.w has 8 bytes here, 16 there"),
    ],
)
def test_a_file_this_node_cannot_build_says_why(items, tensors, why):
    assert chunks(items, tensors)[-1] == why


class _Sharded(torch.Tensor):
    """Stands in for a DTensor (FSDP2's): what `decline_shards` looks for is its placements."""

    placements = ("Shard(0)",)


def test_a_sharded_state_stops_copying_and_committing_in_memory(caplog):
    import logging
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    context = SimpleNamespace(
        tier=object(), nodes=["pod-a", "pod-b"], ranks=SimpleNamespace(rank=0), persist_behind=True
    )
    mirror = mirroring.NodeMirror(context)
    assert mirror.active and mirror.writes
    assert not mirror.decline_shards({"model": {"w": torch.zeros(2)}})  # replicated: copied
    assert context.persist_behind
    sharded = torch.zeros(2).as_subclass(_Sharded)
    assert mirror.decline_shards({"model": {"w": sharded}})
    assert not mirror.active and not context.persist_behind
    assert "a sharded state has no replica on the other pods" in caplog.text
    assert not mirror.decline_shards({"model": {"w": sharded}})  # said once


def test_one_node_copies_nothing():
    from types import SimpleNamespace

    context = SimpleNamespace(
        tier=object(), nodes=["pod-a", "pod-a"], ranks=SimpleNamespace(rank=1), persist_behind=True
    )
    mirror = mirroring.NodeMirror(context)
    assert not mirror.active and not mirror.writes
