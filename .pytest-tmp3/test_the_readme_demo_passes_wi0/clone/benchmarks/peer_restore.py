"""A replacement pod's restore: from the surviving pod's memory (`checkpoint/peers.py`) against from storage (the GCS
emulator, moto's S3 server), for the same checkpoint, side by side.

What is measured
    Two processes on gloo (torch.multiprocessing, 127.0.0.1), two "nodes" (a memory tier each, in /dev/shm), each with
    a DDP model of plain linear layers and its AdamW state (`--mib`, default 258 MiB). The checkpoint is saved once
    to each storage server (committed there, and in both nodes' memory: each node holds every file, `mirroring`).
    Then, `--repeats` times, node 1 is replaced (its memory emptied) and a new store on both ranks restores the
    newest checkpoint (`latest_valid` + `load`, what a restarted worker group does), two ways in turn:
      from peer:    as shipped: node 1 receives every file from node 0's memory, then both load from memory;
      from storage: peer copies off (how it went before): node 1 reads what it needs from storage, and rank 0
                    verifies the checkpoint in storage first (it cannot tell node 1 holds none of it before).
    Seconds are the slower rank's (the group trains again when both are done); each restore's model is checked
    against the saved one. Medians are printed per storage and way, and the ratios storage / peer.

    Both "nodes" share this machine's cores and loopback: a peer copy between two machines also crosses a network
    (about 1-3 GB/s a pod on 10-25 Gb/s Ethernet), storage's servers here answer from the same machine's memory.

Run by hand, never by the test suite (needs gcp-storage-emulator and moto, as `make setup` installs them):
    .venv/bin/python benchmarks/peer_restore.py            # ~3 minutes on the 2-core VM
The last line is `result: peer_s_gcs=<x> storage_s_gcs=<x> ratio_gcs=<x> peer_s_s3=<x> storage_s_s3=<x>
ratio_s3=<x>`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from multinode_checkpoint import free_port

REPO = Path(__file__).resolve().parents[1]
WAYS = ("from peer", "from storage")


def worker(rank: int, port: int, root: str, uri: str, store_kwargs: dict, mib: int, repeats: int) -> None:
    import gcsfs
    import torch
    import torch.distributed as dist
    from fsspec.asyn import AsyncFileSystem
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainingrun_trainer.checkpoint import CheckpointStore, model_digest

    gcsfs.GCSFileSystem._mv_file = AsyncFileSystem._mv_file  # the emulator answers moveTo 501 (as checkpoint_stall)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        width = 1024
        layers = max(1, (mib << 20) // (3 * 4 * width * width))

        def build(seed: int):
            torch.manual_seed(seed)
            model = DDP(torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(2, width)).sum().backward()
            optimizer.step()
            return model, optimizer

        def state_of(model, optimizer) -> dict:
            model_state, optim_state = get_state_dict(model, optimizer)
            return {"model": model_state, "optim": optim_state}

        model, optimizer = build(0)
        expected = model_digest(model.module.state_dict())
        tier = os.path.join(root, f"node-{rank}", "tier")
        with CheckpointStore(uri, memory_tier=tier, **store_kwargs) as store:
            store.save(1, state_of(model, optimizer), {"rank": rank}, blocking=True)
            assert store.wait() is not None, "the save did not commit"
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        sources: dict[str, dict] = {}
        for _ in range(repeats):
            for way in WAYS:
                if rank == 1:
                    shutil.rmtree(tier, ignore_errors=True)  # the replacement pod's empty /dev/shm
                fresh, fresh_optimizer = build(1)
                target = state_of(fresh, fresh_optimizer)
                dist.barrier()
                began = time.perf_counter()
                with CheckpointStore(uri, memory_tier=tier, **store_kwargs) as store:
                    store.restorer._peers.active = way == "from peer"
                    store.load(store.latest_valid(), target)
                    read = store.metrics.last_restore_bytes
                took = time.perf_counter() - began
                slower = torch.tensor([took])
                dist.all_reduce(slower, op=dist.ReduceOp.MAX)
                seconds[way].append(float(slower))
                sources[way] = read
                fresh.module.load_state_dict(target["model"])
                if model_digest(fresh.module.state_dict()) != expected:
                    raise SystemExit(f"rank {rank}: the restore {way} loaded other weights than were saved")
        Path(root, f"rank{rank}.json").write_text(json.dumps({"seconds": seconds, "bytes": sources}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=258, help="model and AdamW state per rank, MiB (default 258)")
    parser.add_argument("--repeats", type=int, default=5, help="restores per way and storage (default 5)")
    args = parser.parse_args(argv)

    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (storage_servers)
    sys.path.insert(0, str(REPO / "tests"))
    import torch.multiprocessing as mp

    from storage_servers import gcs_emulator, moto_s3

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    medians: dict[tuple[str, str], float] = {}
    with gcs_emulator() as gcs, moto_s3() as s3:
        for server, name in ((gcs, "gcs"), (s3, "s3")):
            root = tempfile.mkdtemp(prefix="trainingrun-peer-restore-", dir=shm)
            bucket = server.new_bucket()
            try:
                mp.spawn(
                    worker,
                    args=(
                        free_port(),
                        root,
                        f"{server.scheme}://{bucket}/run",
                        server.store_kwargs,
                        args.mib,
                        args.repeats,
                    ),
                    nprocs=2,
                    join=True,
                )
                results = [json.loads(Path(root, f"rank{rank}.json").read_text()) for rank in range(2)]
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for way in WAYS:
                runs = results[0]["seconds"][way]
                medians[(name, way)] = statistics.median(runs)
                print(
                    f"{name:>3} {way:>12}: median {medians[(name, way)]:.3f} s of {', '.join(f'{s:.3f}' for s in runs)}; "
                    f"replacement read {results[1]['bytes'][way]}",
                    flush=True,
                )
    line = " ".join(
        f"peer_s_{name}={medians[(name, 'from peer')]:.3f} storage_s_{name}={medians[(name, 'from storage')]:.3f} "
        f"ratio_{name}={medians[(name, 'from storage')] / medians[(name, 'from peer')]:.1f}"
        for name in ("gcs", "s3")
    )
    print(f"result: {line}")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO / p) for p in ("common", "trainer_image")]
    sys.exit(main())
