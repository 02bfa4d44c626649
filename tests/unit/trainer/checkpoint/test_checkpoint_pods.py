"""pods.PodHooks: on one pod every hook does nothing and answers as one pod would; on several, how each rank stages,
who persists what, and that every rank stops persisting behind alike when a pod cannot keep every file."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, train_step, wrapped

from trainingrun_trainer.checkpoint import CheckpointStore, memory_tier
from trainingrun_trainer.checkpoint.pods import PodHooks, Staging
from trainingrun_trainer.checkpoint.records import CheckpointInfo, CommitOutcome, RankPart


class RecordingPersister:
    """What the hooks ask of the persister, recorded."""

    def __init__(self, spread: bool = False):
        self.spread = spread
        self.part_done = None
        self.calls: list[tuple] = []

    def queue(self, info, manifest):
        self.calls.append(("queue", info.step, manifest))

    def copy_part(self, info):
        self.calls.append(("copy_part", info.step))

    def plan_parts(self, info, manifest, parts):
        self.calls.append(("plan_parts", info.step, parts))
        return info

    def spread_over_pods(self, leads):
        self.calls.append(("spread_over_pods", leads))
        self.spread = True


def hooks(rank: int, nodes: list[str], spread: bool = False) -> tuple[PodHooks, RecordingPersister]:
    ranks = SimpleNamespace(rank=rank, gather=None, all=None)  # a collective on one pod would fail: None is no call
    context = SimpleNamespace(tier=object(), nodes=nodes, ranks=ranks, persist_behind=True)
    persister = RecordingPersister(spread)
    return PodHooks(context, persister), persister  # type: ignore[arg-type]


def info(step: int) -> CheckpointInfo:
    return CheckpointInfo(
        step=step, uri=f"file:///ckpt/step-{step:08d}", time="", size_bytes=1, valid=True, reason=None
    )


def test_on_one_pod_every_hook_does_nothing_and_rank_0_queues_the_whole_checkpoint():
    for rank in (0, 1):
        pods, persister = hooks(rank, ["pod-a", "pod-a"])
        pods.before_staging({"model": {"w": torch.zeros(2)}})
        assert pods.staging(True, True, {"model": {"w": torch.zeros(2)}}) == Staging()
        assert pods.staging(False, False, {}) == Staging(once=True, copies=False, whole=False)
        assert pods.after_writing(5, {}, {}, [], "/tier/step-5", in_memory=True) is None  # no collective called
        outcome = CommitOutcome(info=info(5), manifest=b"{}")
        pods.at_commit(outcome, [RankPart(None, {}, None, False, None)], "/tier/step-5")
        assert outcome.metadata is None and outcome.copy_part is None
        pods.after_commit(5, outcome, "/tier/step-5")  # no other pod's copy to commit
        pods.persist(outcome)
        assert persister.calls == ([("queue", 5, b"{}")] if rank == 0 else [])
        assert not pods.keeps_replicated_apart and not pods.short_of_room


@pytest.mark.parametrize("rank, lead", [(0, True), (1, False), (2, True)])
def test_on_several_pods_a_lead_keeps_every_tensor_beside_its_file_until_it_may_stage_the_copies(rank, lead):
    """DDP on two pods: each pod's lead rebuilds the other pod's files from its replica, so a save DCP plans stages
    the whole state by the stager, and a save by the last plan keeps every tensor beside the lead's own file (the
    copies' layouts are not known before a first exchange)."""
    pods, _ = hooks(rank, ["pod-a", "pod-a", "pod-b", "pod-b"])
    assert pods.mirror.writes == lead
    assert pods.staging(False, True, {}) == Staging(once=False, copies=False, whole=False)
    assert pods.staging(True, True, {"w": torch.zeros(2)}) == Staging(once=True, copies=False, whole=lead)


def test_spread_over_the_pods_each_lead_copies_its_part_and_rank_0_queues_nothing():
    for rank, copies in ((0, True), (1, False), (2, True)):
        pods, persister = hooks(rank, ["pod-a", "pod-a", "pod-b", "pod-b"], spread=True)
        outcome = CommitOutcome(info=info(7), manifest=b"{}", copy_part=info(6))
        pods.persist(outcome)
        assert persister.calls == ([("copy_part", 6)] if copies else [])


def test_rank_0_plans_the_parts_at_a_commit_in_memory_spread_over_the_pods():
    pods, persister = hooks(0, ["pod-a", "pod-b"], spread=True)
    outcome = CommitOutcome(info=info(9), manifest=b"{}")
    parts = [RankPart(None, {}, None, False, (4, True)), RankPart(None, {}, None, False, (4, True))]
    pods.at_commit(outcome, parts, None)
    assert persister.calls == [("plan_parts", 9, [(4, True), (4, True)])]
    assert outcome.copy_part is not None and outcome.copy_part.step == 9
    failed = CommitOutcome(info=None, error="rank 1: no room")
    pods.at_commit(failed, parts, None)
    assert failed.copy_part is None and len(persister.calls) == 1


def _a_rank_cannot_write_worker(rank: int, init_file: str, uri: str, tiers: list[str], out_dir: str) -> None:
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        ddp = wrapped(0, sharded=False)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True, persist_every_steps=1000) as store:
            fast_path_error = store.committer._fast_path_error

            def no_room_at_step_3(job, *args):
                if rank == 1 and job.step == 3:
                    return "rank 1 had no room in node memory to stage its state after all (injected)"
                return fast_path_error(job, *args)

            store.committer._fast_path_error = no_room_at_step_3  # type: ignore[method-assign]
            behind, committed = [], []
            for step in range(1, 5):
                train_step(ddp, opt, seed=step)
                store.save(step, app_state(ddp, opt), {"rank": rank}, copy_in_background=("model", "optim"))
                committed.append(store.wait() is not None)
                behind.append(store.persist_behind)
            in_memory = store.metrics.committed_saves
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"committed": committed, "behind": behind, "saves": in_memory})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_that_cannot_write_by_its_last_plan_fails_that_save_alone_and_every_rank_goes_on_in_memory(tmp_path):
    """Two pods, saves by the last plan (from the second). Rank 1 cannot write its part of step 3 (no room to stage
    after all): the exchange finds that pod without every file, and that save fails on both ranks; every rank then
    goes on committing in memory alike. Before, the ranks that wrote turned persisting behind off and the one that
    failed did not, so the next save's collectives did not match."""
    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(_a_rank_cannot_write_worker, args=(str(tmp_path / "pg"), uri, tiers, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["committed"] == [True, True, False, True]
        assert result["behind"] == [True] * 4
