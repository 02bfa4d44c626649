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
from checkpoint_states import app_state, flip_byte, local_digest, spawned, step_dir, train_step, wrapped
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainingrun_trainer.checkpoint import CheckpointStore, memory_tier
from trainingrun_trainer.checkpoint.peers import Offer, plan_copies

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


FILES = (".metadata", "__0_0.distcp", "__1_0.distcp")


def offer(step: int, sha: str = "a" * 64, size: int = 100, held: tuple = FILES, listed: tuple = FILES) -> Offer:
    return Offer(step, sha, size, 2, listed, held)


def pods_of(leads: list[int], world_size: int) -> list[list[int]]:
    """The ranks of each pod, each pod from its lead to the next one's."""
    ends = leads[1:] + [world_size]
    return [list(range(lead, end)) for lead, end in zip(leads, ends)]


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
        ([offer(5, held=("../x",)), offer(4)], [0, 1], offer(4), [(1, 0)]),  # holds what it does not list
        ([offer(5, listed=("/etc/passwd",), held=()), offer(4)], [0, 1], offer(4), [(1, 0)]),  # not a plain name
    ],
)
def test_each_pod_without_the_newest_offered_receives_it_from_one_that_holds_it(offers, leads, best, copies):
    plan = plan_copies(offers, pods_of(leads, len(offers)), len(offers))
    expected = [(source, target, best.listed) for source, target in copies]
    assert (plan.best, plan.copies, plan.unserved) == (best, expected, [])


SHARDED = (".metadata", "__0_0.distcp", "__0_replicated.distcp", "__1_0.distcp", "__2_0.distcp")


def sharded(*ranks: int) -> Offer:
    """A pod's offer of a sharded state on three pods: the files of `ranks`, the metadata and the replicated items."""
    held = (".metadata", "__0_replicated.distcp", *(f"__{rank}_0.distcp" for rank in ranks))
    return Offer(5, "a" * 64, 100, 3, SHARDED, tuple(name for name in SHARDED if name in held))


@pytest.mark.parametrize(
    "offers, copies, unserved",
    [
        ([sharded(0, 2), sharded(1, 0), sharded(2, 1)], [], []),  # in place: each its own and its predecessor's
        ([sharded(0, 2), None, sharded(2, 1)], [(2, 1, (".metadata", "__0_replicated.distcp", "__1_0.distcp"))], []),
        ([None, sharded(1, 0), sharded(2, 1)], [(1, 0, (".metadata", "__0_0.distcp", "__0_replicated.distcp"))], []),
        ([sharded(0, 2), None, None], [], [1]),  # two neighbours lost: pod 1's shards are nowhere (pod 2's are on 0)
        ([sharded(0, 2), sharded(2), sharded(2, 1)], [(2, 1, ("__1_0.distcp",))], []),  # its own file gone: only that
    ],
    ids=["in place", "pod 1 lost", "rank 0's pod lost", "two neighbours lost", "a pod lacks one file"],
)
def test_on_three_pods_a_pod_receives_what_its_ranks_read_from_the_pod_that_holds_its_shards(offers, copies, unserved):
    """A sharded state on three pods: no pod holds every file, each its own shards and its predecessor's (the ring),
    so a lost pod gets its own shards, the metadata and the replicated items from the next pod; storage when the
    next pod is lost too."""
    plan = plan_copies(offers, [[0], [1], [2]], 3)
    assert plan.best is not None and plan.best.same_checkpoint(sharded())
    assert (plan.copies, plan.unserved) == (copies, unserved)


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


def _three_pods_worker(rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str, lost: list, damage: bool):
    """FSDP2 on three pods of one rank: step 5 saved (to storage: no pod holds every file), then the pods `lost`
    replaced (their memory empty), `damage`: the copy of rank 1's shards on pod 2 damaged; a new group restores."""
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainingrun.checkpoint").addHandler(handler)
    logging.getLogger("trainingrun.checkpoint").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    try:
        model = wrapped(0, sharded=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt, seed=100)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            store.save(5, app_state(model, opt), {"rank": rank})
            assert store.wait() is not None
        dist.barrier()
        if rank in lost:
            shutil.rmtree(tiers[rank])
        if rank == 2 and damage:
            flip_byte(step_dir(Path(tiers[rank]), 5) / "__1_0.distcp")
        dist.barrier()
        fresh = wrapped(1, sharded=True)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = app_state(fresh, fresh_opt)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
            found = store.latest_valid()
            extra = store.load(found, state)
            metrics = store.metrics
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        result = {
            "rank": extra["rank"],
            "source": metrics.last_restore_source,
            "bytes": metrics.last_restore_bytes,
            "same": local_digest(fresh) == local_digest(model),
            "said": said,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "lost, damage",
    [([1], False), ([0], False), ([1, 2], False), ([1], True)],
    ids=["pod 1 lost", "rank 0's pod lost", "two neighbours lost", "the copy of its shards damaged"],
)
def test_on_three_pods_a_lost_pod_receives_its_shards_from_the_next_pod_else_reads_storage(tmp_path, lost, damage):
    """FSDP2 on three pods: each pod holds its own shards, its predecessor's, the metadata and the replicated items. A
    replacement receives what its rank reads from the next pod (it holds the lost pod's shards through the ring), and
    no rank reads storage. With the next pod lost too, or the copy damaged, that pod's shards are read from storage
    (verified by rank 0). Each rank gets back its own shards bitwise in every case."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(3)]
    uri = f"file://{tmp_path / 'ckpt'}"
    results = spawned(_three_pods_worker, 3, tmp_path, str(tmp_path / "pg"), uri, tiers, str(tmp_path), lost, damage)
    assert [(r["rank"], r["same"]) for r in results] == [(0, True), (1, True), (2, True)]
    storage = [r["bytes"]["storage"] for r in results]
    if lost == [1, 2]:
        assert any("no pod's memory holds all that the pods of rank 1 read" in said for said in results[0]["said"])
        assert storage[0] > 0 and all(r["bytes"]["peer"] == 0 for r in results)
    elif damage:
        assert any("do not match the manifest" in said for said in results[1]["said"]), results[1]["said"]
        assert storage[0] > 0  # rank 0 verified storage, as no pod's memory holds all that pod 1 reads now
    else:
        (replacement,) = lost
        source = (replacement + 1) % 3
        assert storage == [0, 0, 0]
        assert results[replacement]["source"] == "peer" and results[replacement]["bytes"]["own_memory"] == 0
        said = results[replacement]["said"]
        assert any(f"from rank {source}'s memory in" in line and "3 of its 5 files" in line for line in said), said
        assert all(results[r]["source"] == "memory" for r in range(3) if r != replacement)
