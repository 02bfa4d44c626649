"""Checkpoint bookkeeping: the CPU one save costs each rank when the state is small, by thread, planning every save
(DCP's default planner) against planning once per layout and against writing by the last plan without `dcp.save`
(the store's, `checkpoint/save_planner.py`).

What is measured
    Two processes on gloo (torch.multiprocessing, 127.0.0.1), each with the trainer's small benchmark model
    (`CharTransformer` dim 128, 2 layers, 4 heads, context 64: 0.44 M parameters) and its AdamW state, and a
    `CheckpointStore` persisting behind (memory tier in /dev/shm, storage file:// in a temp dir), as the trainer saves:
    `save(..., copy_in_background=("model", "optim"), model_digest=DigestOfEntry("model"))`, `wait_copied()`, then
    `wait()` and `wait_persisted()` so that each save is whole before the next. After `--warmup` saves, `--saves` saves are timed: each rank's CPU time per
    save (getrusage) and per thread (/proc/self/task: the training thread, the store's checkpoint and persister threads,
    gloo's), and the wall time per save. No training runs beside the saves: this is what a save costs, not what it
    costs the steps beside it (`trainer_overhead.py --checkpoint-every` measures that).

    Sides: "plans every save" (torch's DefaultSavePlanner through `dcp.save`: every rank builds its plan and sends it
    to rank 0, which merges them and sends each its final plan, then gathers the write results and sends every rank
    the metadata), "plans once" (the store's planner through `dcp.save`, as before the store skipped it) and "by the
    last plan" (the store as it is: while every rank's layout is unchanged, each writes by its last plan and rank 0
    writes the metadata from the results it gathers anyway, and each rank stages only the tensors its plan writes).
    Each side runs `--repeats` times, alternating; medians
    are printed.

Run by hand, never by the test suite:
    /work/venv/bin/python benchmarks/checkpoint_bookkeeping.py          # ~1 minute on the 2-core VM
The last line is `result: cpu_ms_per_save_plans_once=<x> cpu_ms_per_save_plans_every_save=<x> ratio=<x>
cpu_ms_per_save_by_last_plan=<x> ratio_by_last_plan=<x> node_memory_bytes_by_last_plan=<x>
node_memory_bytes_plans_once=<x>` (both ranks summed; ratios against planning every save; the bytes are the data files
one save puts in node memory, which persisting then copies to storage).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

SIDES = ("plans every save", "plans once", "by the last plan")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by its Python name (else its OS name)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        name = names.get(int(tid), comm).rstrip("_0123456789") or comm
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def worker(rank: int, port: int, root: str, side: str, warmup: int, saves: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainingrun_trainer.checkpoint import CheckpointStore, DigestOfEntry
    from trainingrun_trainer.checkpoint.save_planner import ReusingSavePlanner
    from trainingrun_trainer.models import CharTransformer

    class PlansEverySave(DefaultSavePlanner):
        def repeats(self, state_dict, is_coordinator):
            return False  # through dcp.save

    class PlansOnce(ReusingSavePlanner):
        def repeats(self, state_dict, is_coordinator):
            return False

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=128, dim=128, layers=2, heads=4, context_length=64)
    optimizer = torch.optim.AdamW(model.parameters())
    model({"tokens": torch.randint(0, 128, (2, 65))}).backward()
    optimizer.step()  # AdamW's moments exist
    model_state, optim_state = get_state_dict(model, optimizer)
    tier = tempfile.mkdtemp(prefix="checkpoint-bookkeeping-", dir="/dev/shm") if rank == 0 else None
    tier = [tier]
    dist.broadcast_object_list(tier)
    store = CheckpointStore(f"file://{root}/ckpt", memory_tier=tier[0], persist_behind=True, run_uid="bench")
    if side == SIDES[0]:
        store.committer.planner = PlansEverySave  # torch's default
    elif side == SIDES[1]:
        store.committer.planner = lambda: PlansOnce(store.committer.plans_key, store.committer._planned)

    def save(step: int) -> None:
        store.save(
            step,
            {"model": model_state, "optim": optim_state},
            {"step": step},
            copy_in_background=("model", "optim"),
            model_digest=DigestOfEntry("model"),
        )
        store.wait_copied()
        if store.wait() is None:
            raise SystemExit(f"rank {rank}: the save of step {step} did not commit")
        store.wait_persisted()

    for step in range(1, warmup + 1):
        save(step)
    dist.barrier()
    threads_before, usage_before, began = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for step in range(warmup + 1, warmup + saves + 1):
        save(step)
    wall = time.perf_counter() - began
    usage, threads = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
    cpu = usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime
    per_thread = {name: (seconds - threads_before.get(name, 0.0)) * 1000 / saves for name, seconds in threads.items()}
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "cpu_ms": cpu * 1000 / saves,
                "wall_ms": wall * 1000 / saves,
                "threads": per_thread,
                "bytes": store.metrics.last_save_bytes,  # this rank's files of the last save, in node memory
            }
        )
    )
    store.close()
    dist.destroy_process_group()
    if tier[0] and rank == 0:
        shutil.rmtree(tier[0], ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    import json

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=40, help="timed saves per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="saves before timing (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating (default 3)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            with tempfile.TemporaryDirectory(prefix="checkpoint-bookkeeping-") as root:
                mp.spawn(worker, args=(free_port(), root, side, args.warmup, args.saves, root), nprocs=2, join=True)
                runs[side].append([json.loads(Path(root, f"rank{r}.json").read_text()) for r in range(2)])
    print(f"{'per save, medians of ' + str(args.repeats) + ' runs':<44}" + "".join(f"{side:>22}" for side in SIDES))
    total = {}
    for rank in range(2):
        for figure in ("cpu_ms", "wall_ms"):
            cells = [statistics.median(run[rank][figure] for run in runs[side]) for side in SIDES]
            label = f"rank {rank} {'CPU' if figure == 'cpu_ms' else 'wall'} ms"
            print(f"{label:<44}" + "".join(f"{cell:>22.1f}" for cell in cells))
        names = sorted({name for side in SIDES for run in runs[side] for name in run[rank]["threads"]})
        for name in names:
            cells = [statistics.median(run[rank]["threads"].get(name, 0.0) for run in runs[side]) for side in SIDES]
            if max(cells) >= 0.5:
                print(f"{'  thread ' + name + ' CPU ms':<44}" + "".join(f"{cell:>22.1f}" for cell in cells))
    for side in SIDES:
        total[side] = statistics.median(run[0]["cpu_ms"] + run[1]["cpu_ms"] for run in runs[side])
    ratio, ratio_by_last_plan = total[SIDES[1]] / total[SIDES[0]], total[SIDES[2]] / total[SIDES[0]]
    stored = {side: statistics.median(run[0]["bytes"] + run[1]["bytes"] for run in runs[side]) for side in SIDES}
    print(f"{'both ranks: bytes in node memory':<44}" + "".join(f"{stored[side]:>22,.0f}" for side in SIDES))
    print(
        f"both ranks' CPU per save: {total[SIDES[2]]:.1f} ms by the last plan ({ratio_by_last_plan:.2f}x planning every "
        f"save), {total[SIDES[1]]:.1f} ms planning once ({ratio:.2f}x), {total[SIDES[0]]:.1f} ms planning every save"
    )
    print(
        f"result: cpu_ms_per_save_plans_once={total[SIDES[1]]:.1f} cpu_ms_per_save_plans_every_save="
        f"{total[SIDES[0]]:.1f} ratio={ratio:.3f} cpu_ms_per_save_by_last_plan={total[SIDES[2]]:.1f} "
        f"ratio_by_last_plan={ratio_by_last_plan:.3f} node_memory_bytes_by_last_plan={stored[SIDES[2]]:.0f} "
        f"node_memory_bytes_plans_once={stored[SIDES[1]]:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
