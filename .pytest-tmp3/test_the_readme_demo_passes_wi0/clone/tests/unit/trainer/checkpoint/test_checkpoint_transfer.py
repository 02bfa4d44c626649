"""transfer.FileTransfer: whole files from one rank's memory tier to another's over gloo, each kept only when its
digest is the one the receiver was told; a sender's missing or damaged file costs the receiver that file alone."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

from trainingrun_trainer.checkpoint import transfer
from trainingrun_trainer.checkpoint.memory_tier import MemoryTier


def test_a_file_is_sent_in_pieces_of_at_most_the_chunk_size():
    assert list(transfer.chunks(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(transfer.chunks(0, 4)) == []


def _worker(rank: int, init_file: str, root: str, chunk_bytes: int) -> None:
    transfer.CHUNK_BYTES = chunk_bytes  # several pieces a file, both buffers of the sender in use
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        seeded = random.Random(0)  # the same bytes in both processes
        contents = {"kept.bin": seeded.randbytes(5000), "empty.bin": b"", "damaged.bin": seeded.randbytes(3000)}
        entries = [
            {"path": name, "size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
            for name, data in contents.items()
        ]
        entries.append({"path": "missing.bin", "size": 100, "xxh3_128": xxhash.xxh3_128(b"x" * 100).hexdigest()})
        tier = MemoryTier(os.path.join(root, f"node-{rank}"))
        directory = os.path.join(tier.root, "step-00000001")
        os.makedirs(directory)
        moving = transfer.FileTransfer(dist.group.WORLD, tier)
        if rank == 0:
            for name, data in contents.items():
                Path(directory, name).write_bytes(data if name != "damaged.bin" else data[:-1] + b"\0")
            if moving.get_flag(1):
                moving.send_files([(os.path.join(directory, e["path"]), e["size"]) for e in entries], 1)
        else:
            moving.put_flag(True, 0)
            dropped = moving.receive_files(directory, entries, "xxh3_128", 0)
            held = {
                name: Path(directory, name).read_bytes() == contents[name]
                for name in sorted(os.listdir(directory))
                if not name.endswith(".xxh3")
            }
            digests = json.loads(Path(directory, "kept.bin.xxh3").read_text())
            Path(root, "result.json").write_text(json.dumps({"dropped": dropped, "held": held, "digests": digests}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_only_files_whose_digest_matches_are_kept_each_with_its_digests_file(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "pg"), str(tmp_path), 1024), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["dropped"] == ["damaged.bin", "missing.bin"]  # zeros for what the sender lacked: not its digest
    assert result["held"] == {"empty.bin": True, "kept.bin": True}  # nothing partial left behind
    assert result["digests"]["size"] == 5000 and len(result["digests"]["xxh3_128"]) == 1
