"""Checkpoints of two pods against one: the commit in node memory and an in-place restart's restore, with the ranks
on one node (one memory tier) or on two (a tier each: each node's lowest rank also writes the other node's files,
`checkpoint/mirroring.py`, and the commit waits until both nodes hold every file).

`--strategy fsdp2` shards the same state over the two ranks (FSDP2, CPU only: gloo): on two nodes each node's lead then
receives the other node's shards over the process group after each save (the ring), instead of rebuilding them from
its own replica. `--nodes 3` (or more) runs as many ranks, one a node on the several-node side: with fsdp2 no node then
holds every file, and persisting is spread over the nodes (`checkpoint/persisting.py`); the line says whether saves
committed in memory.

What is measured
    Two processes on gloo (torch.multiprocessing, 127.0.0.1), each with a DDP model of plain linear layers and its
    AdamW state (`--mib`, default 258 MiB: a third parameters, two thirds AdamW's moments) and a `CheckpointStore`
    persisting behind (memory tiers in /dev/shm, storage file:// in a temp dir, a storage interval of 1,000 steps so
    that no copy to storage runs beside the timed saves). After `--warmup` saves, `--saves` saves are timed on rank 0:
    its `last_save_seconds` (from `save()` to the commit in memory, what `wait()` returns after); then a new store in
    the same processes (an in-place restart: the same node memory) restores the newest checkpoint, timed with its bytes
    by source (own memory, storage). Each side runs `--repeats` times, alternating; medians are printed.

    The two "nodes" share this machine's cores and memory bandwidth: the mirror's extra write competes with the other
    rank here, as it would not on two machines, so the ratio is an upper bound. `--pin` puts each rank (its threads
    too) on a core of its own on both sides, so the nodes' work runs side by side as on two machines (the memory
    bandwidth is still shared; the one-node side's hashing threads lose the other core).

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/multinode_checkpoint.py          # ~3 minutes on the 2-core VM
On a GPU machine, the same from CUDA (staging off the device on both "nodes"), in one device call as gpu_suite.py's
docstring sets it up: `... python3 benchmarks/multinode_checkpoint.py --device cuda --mib 1800` (not yet run).
The last line is `result: strategy=<ddp|fsdp2> nodes=<n> commit_s_one_node=<x> commit_s_nodes=<x> ratio=<x>
restore_s_one_node=<x> restore_s_nodes=<x> storage_bytes_read_nodes=<x> committed_in_memory=<True|False>`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
from pathlib import Path

SIDES = ("one node", "several nodes")


def worker(
    rank: int,
    port: int,
    root: str,
    side: str,
    mib: int,
    warmup: int,
    saves: int,
    device: str,
    strategy: str,
    pin: bool = False,
    nodes: int = 2,
) -> None:
    if pin:  # each rank, its threads included, on a core of its own: two machines' worth of cores, one each
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainingrun_trainer.checkpoint import CheckpointStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nodes)
    try:
        width = 1024
        layers = max(1, (mib << 20) // (3 * 4 * width * width))
        torch.manual_seed(0)
        layers_on = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in layers_on:
                fully_shard(layer)
            model = fully_shard(layers_on)
        else:
            model = DDP(layers_on)  # gloo: both "nodes" may share one GPU
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width, device=device)).sum().backward()
        optimizer.step()  # AdamW's moments exist

        def state() -> dict:
            model_state, optim_state = get_state_dict(model, optimizer)
            return {"model": model_state, "optim": optim_state}

        node = rank if side == "several nodes" else 0
        tier = os.path.join(root, f"node-{node}", "tier")
        uri = f"file://{root}/storage"
        committed = []
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True, persist_every_steps=1000) as store:
            for step in range(1, warmup + saves + 1):
                store.save(step, state(), {"rank": rank}, copy_in_background=("model", "optim"))
                assert store.wait() is not None, "a save did not commit"
                if step > warmup:
                    committed.append(store.metrics.last_save_seconds)
                    phases = store.metrics.last_save_phases
            behind = store.persist_behind
            staged_copies = store.committer.mirror.staged_copies_kept
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True) as store:  # an in-place restart
            restoring = state()
            store.load(store.latest_valid(), restoring)
            restore_seconds, read = store.metrics.last_restore_seconds, store.metrics.last_restore_bytes
        if rank == 0:
            Path(root, "result.json").write_text(
                json.dumps(
                    {
                        "commit": statistics.median(committed),
                        "restore": restore_seconds,
                        "storage_read": read.get("storage", 0),
                        "behind": behind,
                        "staged_copies": staged_copies,
                        "phases": {name: round(seconds, 3) for name, seconds in phases.items()},
                    }
                )
            )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mib", type=int, default=258, help="model and AdamW state (per rank with DDP, over both with fsdp2), MiB"
    )
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp", help="replicated or sharded (CPU)")
    parser.add_argument("--nodes", type=int, default=2, help="ranks, one a node on the several-node side (default 2)")
    parser.add_argument("--saves", type=int, default=4, help="timed saves per run (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="saves before timing (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating (default 3)")
    parser.add_argument(
        "--device", default="cpu", help="where the model trains: cpu, or cuda (both ranks on GPU 0, gloo; default cpu)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each rank on a core of its own (both sides), so the two nodes' work runs side by side as on two "
        "machines instead of sharing every core (on the 2-core VM: one core a node)",
    )
    args = parser.parse_args(argv)
    if args.strategy == "fsdp2" and args.device != "cpu":
        parser.error("--strategy fsdp2 runs on --device cpu only (the ranks talk gloo)")

    import torch.multiprocessing as mp

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            root = tempfile.mkdtemp(prefix="trainingrun-multinode-", dir=shm)
            try:
                mp.spawn(
                    worker,
                    args=(
                        free_port(),
                        root,
                        side,
                        args.mib,
                        args.warmup,
                        args.saves,
                        args.device,
                        args.strategy,
                        args.pin,
                        args.nodes,
                    ),
                    nprocs=args.nodes,
                    join=True,
                )
                runs[side].append(json.loads(Path(root, "result.json").read_text()))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            last = runs[side][-1]
            print(
                f"{side:>13}: commit {last['commit']:.3f} s, restore {last['restore']:.3f} s, "
                f"{last['storage_read']} bytes read from storage, committing in memory: {last['behind']}, copies staged "
                f"in place: {last['staged_copies']}; the last save "
                f"by phase {last['phases']}",
                flush=True,
            )

    def median(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    one, several = median("one node", "commit"), median("several nodes", "commit")
    print(
        f"result: strategy={args.strategy} nodes={args.nodes} commit_s_one_node={one:.3f} "
        f"commit_s_nodes={several:.3f} ratio={several / one:.2f} "
        f"restore_s_one_node={median('one node', 'restore'):.3f} restore_s_nodes={median('several nodes', 'restore'):.3f} "
        f"storage_bytes_read_nodes={int(median('several nodes', 'storage_read'))} "
        f"committed_in_memory={all(run['behind'] for run in runs['several nodes'])}"
    )
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("common", "trainer_image")]
    sys.exit(main())
