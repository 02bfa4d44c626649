"""ranks.RankGroup: without torch.distributed every collective is the identity on rank 0 of 1; with it (two gloo
processes here), gather and broadcast go rank order and rank 0's way, `all` ands each flag, and a group over a subset
numbers its ranks within it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainingrun_trainer.checkpoint.ranks import RankGroup

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_one_process_is_rank_0_of_1_and_every_collective_is_the_identity():
    ranks = RankGroup()
    assert (ranks.distributed, ranks.rank, ranks.world_size) == (False, 0, 1)
    assert ranks.gather("x") == ["x"] and ranks.gather_to_first("x") == ["x"]
    assert ranks.all(True, False) == [True, False] and ranks.broadcast({"a": 1}) == {"a": 1}


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ranks = RankGroup()
        subset = RankGroup(dist.new_group(ranks=[1, 2], backend="gloo"))
        result = {
            "rank": ranks.rank,
            "gathered": ranks.gather(f"r{rank}"),
            "first": ranks.gather_to_first(rank * 10),
            "all": ranks.all(True, rank != 1),
            "broadcast": ranks.broadcast(f"from {rank}"),
        }
        if rank in (1, 2):
            result["subset"] = [subset.rank, subset.world_size, subset.gather(rank)]
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_three_ranks_gather_in_rank_order_and_take_rank_0s_broadcast(tmp_path):
    mp.spawn(_worker, args=(3, str(tmp_path / "pg"), str(tmp_path)), nprocs=3, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["gathered"] == ["r0", "r1", "r2"]
        assert result["first"] == ([0, 10, 20] if rank == 0 else [])
        assert result["all"] == [True, False]
        assert result["broadcast"] == "from 0"
    assert results[1]["subset"] == [0, 2, [1, 2]] and results[2]["subset"] == [1, 2, [1, 2]]
