"""peers.PeerCopies: a pod whose memory lost the newest checkpoint (a replacement for a lost pod) receives it from a
surviving pod's memory before the restore, checked file by file against the manifest, and storage is read only where
no pod holds it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, flip_byte, local_digest, step_dir, train_step, wrapped
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainingrun_trainer.checkpoint import CheckpointStore, memory_tier
from trainingrun_trainer.checkpoint.peers import Offer, plan_copies

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def offer(step: int, sha: str = "a" * 64, size: int = 100) -> Offer:
    return Offer(step, sha, size)


@pytest.mark.parametrize(
    "offers, leads, best, copies",
    [
        ([None, None], [0, 1], None, []),  # a new attempt: no pod holds one
        ([offer(5), offer(5)], [0, 1], offer(5), []),  # an in-place restart: every pod holds it
        ([offer(5), None], [0, 1], offer(5), [(0, 1)]),  # pod 1 replaced
        ([None, offer(5)], [0, 1], offer(5), [(1, 0)]),  # rank 0's pod replaced
        ([offer(5), offer(3)], [0, 1], offer(5), [(0, 1)]),  # an older one is no use
        ([offer(5), None, None, offer(5), None, None], [0, 1, 3, 4], offer(5), [(0, 1), (3, 4)]),
        ([offer(5), None, offer(5, "b" * 64)], [0, 1, 2], offer(5), [(0, 1), (0, 2)]),  # one step, two manifests
        ([offer(5, size=0), offer(4)], [0, 1], offer(4), [(1, 0)]),  # an impossible offer is none
        ([offer(5), offer(6)], [0], offer(5), []),  # only a pod's lowest rank offers
        ([offer(5, "Z" * 64), offer(4)], [0, 1], offer(4), [(1, 0)]),  # not a sha256
        ([("step", 9), offer(4)], [0, 1], offer(4), [(1, 0)]),  # not an offer at all
        ([offer(5, size=1 << 40), None], [0, 1], None, []),  # a manifest no reader would take
    ],
)
def test_each_pod_without_the_newest_offered_receives_it_from_one_that_holds_it(offers, leads, best, copies):
    assert plan_copies(offers, leads) == (best, copies)


def _replacement_worker(
    rank: int,
    init_file: str,
    uri: str,
    tiers: list[str],
    out_dir: str,
    lost: int,
    memory_only: bool,
    damage: bool,
    sharded: bool,
) -> None:
    """Two ranks on two nodes commit step 5 in memory; then node `lost` is replaced (its memory empty), with storage
    not holding the step (`memory_only`: as one not yet persisted behind) or a damaged copy on the survivor; a new
    worker group restores. `sharded`: FSDP2 instead of DDP."""
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainingrun.checkpoint").addHandler(handler)
    logging.getLogger("trainingrun.checkpoint").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ddp = wrapped(0, sharded)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        train_step(ddp, opt, seed=100)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            store.save(5, app_state(ddp, opt), {"rank": rank})
            assert store.wait() is not None
            assert store.persist_behind  # committed in memory, every file on both nodes
        dist.barrier()
        survivor = 1 - lost
        if rank == lost:
            shutil.rmtree(tiers[rank])  # a new pod's /dev/shm
        if rank == survivor and damage:
            flip_byte(max(step_dir(Path(tiers[rank]), 5).glob("__*.distcp"), key=lambda p: p.stat().st_size))
        if rank == 0 and memory_only:
            shutil.rmtree(step_dir(Path(uri.removeprefix("file://")), 5))
        dist.barrier()
        fresh = wrapped(1, sharded)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = app_state(fresh, fresh_opt)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            found = store.latest_valid()
            extra = store.load(found, state) if found is not None else None
            metrics = store.metrics
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "step": found.step if found else None,
                    "rank": extra["rank"] if extra else None,
                    "source": metrics.last_restore_source,
                    "bytes": metrics.last_restore_bytes,
                    "digest": local_digest(fresh),
                    "expected": local_digest(ddp),
                    "said": said,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def replaced(
    tmp_path: Path, lost: int, memory_only: bool = False, damage: bool = False, sharded: bool = False
) -> list[dict]:
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    mp.spawn(
        _replacement_worker,
        args=(
            str(tmp_path / "pg-store"),
            f"file://{tmp_path / 'ckpt'}",
            tiers,
            str(tmp_path),
            lost,
            memory_only,
            damage,
            sharded,
        ),
        nprocs=2,
        join=True,
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "lost, sharded",
    [(1, False), (0, False), (1, True), (0, True)],
    ids=["another pod lost", "rank 0's pod lost", "FSDP2, another pod lost", "FSDP2, rank 0's pod lost"],
)
def test_a_replacement_pod_restores_from_the_survivors_memory_reading_nothing_from_storage(tmp_path, lost, sharded):
    """The step only memory held (storage lacks it, as one not yet persisted behind): the replacement receives every
    file from the surviving pod, and both restore it, no byte from storage; the survivor from its own memory. With
    FSDP2 the survivor holds the lost pod's shards because the lost pod sent them after the save (`mirroring`'s
    ring): each rank gets back its own shards, bitwise."""
    results = replaced(tmp_path, lost, memory_only=True, sharded=sharded)
    assert [r["step"] for r in results] == [5, 5]
    assert [r["rank"] for r in results] == [0, 1]
    survivor = 1 - lost
    assert results[lost]["source"] == "peer" and results[survivor]["source"] == "memory"
    assert results[lost]["bytes"]["peer"] > 0 and results[lost]["bytes"]["own_memory"] == 0
    assert results[survivor]["bytes"]["own_memory"] > 0 and results[survivor]["bytes"]["peer"] == 0
    assert [r["bytes"]["storage"] for r in results] == [0, 0]
    assert any(f"from rank {survivor}'s memory in" in said for said in results[lost]["said"]), results[lost]["said"]
    assert [r["digest"] for r in results] == [r["expected"] for r in results]
    assert (results[0]["expected"] != results[1]["expected"]) == sharded  # a shard each, or one replica


@pytest.mark.slow
def test_a_damaged_copy_on_the_survivor_is_not_kept_and_both_restore_what_was_committed_from_storage(tmp_path):
    """A byte flipped in the survivor's memory: the replacement's copy of that file does not match the manifest, so it
    keeps none and reads storage (saying so); the survivor finds its damage as it loads and reads that file again from
    storage. Both load the committed model."""
    results = replaced(tmp_path, lost=1, damage=True)
    assert [r["step"] for r in results] == [5, 5]
    assert any("do not match the manifest" in said for said in results[1]["said"]), results[1]["said"]
    assert results[1]["bytes"]["storage"] > 0 and results[1]["bytes"]["peer"] == 0
    assert results[0]["digest"] == results[1]["digest"] == results[0]["expected"]
