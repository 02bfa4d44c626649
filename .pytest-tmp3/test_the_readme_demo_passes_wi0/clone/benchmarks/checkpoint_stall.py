"""Checkpoint stall: how long an async `CheckpointStore.save` blocks training, vs a plain `torch.save`.

What is measured
    A training state of model + AdamW (both moments initialised by real steps) for a
    `trainingrun_trainer.models.CharTransformer` (default dim 768, 3 layers, 12 heads, context 64:
    21.5 M parameters, so 86 MB of weights + 172 MB of AdamW moments = 258 MB of state;
    `--dim/--layers` scale it), single process, written to a local temp dir (file://, same
    disk for every side; `--dir` picks the disk). Per repeat (default 3; medians are reported):

    * async save, as the trainer saves (trainer.py `Trainer._save`; its checkpoint thread writes the files): the
      state as DCP Stateful entries
      (`state.ModelState`, `state.OptimizerState`: the store calls their state_dict() while it stages)
      and the model digest as a function of the staged state (computed in the background), then
      `store.save(..., blocking=False, copy_in_background=("model", "optim", "ema"))`: the weights and AdamW
      moments are copied by the background thread while the next step's forward and backward pass run, and that
      step waits for the copy (`store.wait_copied()`) before its optimizer step changes them. "trainer save path"
      = the wall time of the save() call + that wait: how long the training loop is blocked
      (`PendingSave.blocking_seconds` beside it).
    * the steps after it: real training steps (forward, backward, clip, AdamW step, which changes
      the very tensors being saved) run at once, until the save has committed (at most
      `--max-overlap-steps`); the benchmark checks the background write was still in flight when
      the first one began (the overlap is real) and times them against steps with no save in flight
      ("effective stall" = save() blocking + the extra time of those steps: what the background
      write costs training when they share the CPU cores); then `store.wait()`. "save-to-commit" is
      `store.metrics.last_save_seconds` (staging start to manifest written). The committed checkpoint must
      restore to the weights at save() time, not the ones after the steps that overlapped it.
    * persisting behind, as the trainer saves by default (rows "[persist behind]"; `CheckpointStore(persist_behind=True)`
      with a memory tier in /dev/shm; the tensors are staged straight into its files, `checkpoint.tier_staging`):
      the same async save, "save-to-commit" being the commit in memory, then `flush()` and "then persisted to storage"
      (`store.metrics.last_persist_seconds`: copying the files to storage); its CPU row counts both tiers (the checkpoint
      thread and the persister thread). `commit_vs_torch_save` in the result line is this commit /
      torch.save (issue 37's target <= 0.5), `persist_vs_torch_save` the copy to storage after it,
      `background_cpu_ratio_persist_behind` the CPU of both tiers / torch.save's (target <= 1.5).
    * the CPU seconds each save's background work used (the store's checkpoint thread, from /proc) against torch.save's (`background_cpu_ratio`): what the steps beside the write share
      their cores with. On the 2-core dev VM they lose part of it (the effective stall), the rest runs in time
      training leaves idle.
    * sync baselines: `torch.save` of the same state dict into a new file in the same directory,
      kept (as checkpoints are), twice per repeat; the faster of the two is the denominator of the
      ratio (the stricter choice: on VMs that hand free memory back to the host, such as the 2-core
      dev VM, writing into first-touched page-cache memory is at random several times slower, and
      so are the store's background writes). Also: `os.fsync` of that file (durable, as the
      store's files are), and `store.save(..., blocking=True)`.
    * restore: `CheckpointStore.load` into a freshly built model + AdamW state (then
      `set_state_dict`, as the trainer's resume does), vs `torch.load` + `set_state_dict`; and the
      resume path `latest_valid()` (re-hashes every file) + load. The files were just written, so
      the page cache is warm for every reader alike.
    * restore as a restarted process resumes (a new `CheckpointStore`, `latest_valid()` + `load()` into a fresh
      model + AdamW), `--restore-repeats` times (default 3) each: from the GCS emulator, from moto's S3 server (both
      on 127.0.0.1, so no network latency: the figures favour storage) as a new pod does (its memory tier empty: each
      file is verified while it is read and kept there, then loaded from there), and from the memory tier in /dev/shm
      that the save filled (only the listing and the manifest come from storage; each file's content is checked against the xxh3_128
      of its 4 MiB segments as it loads, two threads reading a file). The
      restored weights must equal the saved ones, and each restore must have read where it says. Beside each restore
      from storage, fsspec alone reads the same files (a new filesystem, one find, one cat of every file):
      `storage_restore_vs_fsspec` = that read / the restore, the slowest storage (issue 37's target >= 0.8).
      Beside each memory restore, the copy floor: the tier's data files copied alone (no listing, metadata, checks or
      placing into tensors) into memory already touched, by as many threads as a restore reads a file with:
      `memory_restore_vs_copy_floor` = the slower memory restore / that copy, and `copy_floor_vs_torch_load`, what
      issue 37's `memory_restore_vs_torch_load` <= 0.2 asks of this machine's memory before any other work.

Targets
    memory_restore_speedup = the faster of the two storage restores / the slower of the memory restores >= 10
    (issue 19).
    blocking_ratio = async_blocking_seconds / sync_torch_save_seconds <= 0.10, where async_blocking_seconds is
    the wall time of the `store.save(..., blocking=False)` call (in-process writer); trainer_blocking_ratio (the
    trainer's whole save path on the training thread / torch.save) <= 0.05 and effective_stall_ratio (effective
    stall / torch.save) <= 0.5 (issue 19). The denominator moves between runs on a shared VM, so each ratio is taken per repeat
    (against that repeat's torch.save) and reported as the median of the repeats (default 5), with the spread.

Run by hand, never by the test suite:
    /work/venv/bin/python benchmarks/checkpoint_stall.py                      # defaults, ~1 minute
    /work/venv/bin/python benchmarks/checkpoint_stall.py --dim 2048 --layers 8 --device cuda
The last line is `result: blocking_ratio=<x> async_blocking_seconds=<x> sync_save_seconds=<x>
restore_seconds=<x> state_mb=<x> ... memory_restore_speedup=<x>`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class LocalDisk:
    """A file:// "server" for machines without the storage emulators (the GPU machine): checkpoints on its disk."""

    scheme, store_kwargs = "file", {}

    def __init__(self, root: str):
        self.root = root

    def new_bucket(self) -> str:
        return tempfile.mkdtemp(prefix="bucket-", dir=self.root).lstrip("/")


@contextlib.contextmanager
def restore_servers(source: str):
    """[(server, name)] to restore from: the GCS emulator and moto's S3 server, or this machine's disk."""
    if source == "file":
        with tempfile.TemporaryDirectory(prefix="checkpoint-stall-disk-") as root:
            yield [(LocalDisk(root), "file")]
        return
    import gcsfs
    from fsspec.asyn import AsyncFileSystem

    sys.path.insert(0, str(REPO / "tests"))
    from storage_servers import gcs_emulator, moto_s3

    # The emulator answers GCS's moveTo (DCP renames .metadata.tmp) with 501 and gcsfs retries it for ~33 s before
    # it copies; real GCS moves. As the tests' gcs_move_is_copy fixture does.
    gcsfs.GCSFileSystem._mv_file = AsyncFileSystem._mv_file
    with gcs_emulator() as gcs, moto_s3() as s3:
        yield [(gcs, "GCS"), (s3, "S3")]


def measure_restores(
    state: dict, step: int, fresh_state, digest_of, repeats: int, source: str = "servers"
) -> dict[str, list[float]]:
    """Seconds of each restore of `state` (saved once per storage server with a memory tier), as a restarted process
    resumes: {"GCS emulator": [...], "moto S3": [...], "memory (GCS listing)": [...], "memory (S3 listing)": [...]}
    (`source` "file": {"file on disk": [...], "memory (file listing)": [...]}).
    `fresh_state()` gives (a state to load into, a function of it that gives the model digest)."""
    from trainingrun_trainer.checkpoint import CheckpointStore

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    expected = digest_of(state)
    seconds: dict[str, list[float]] = {}
    with restore_servers(source) as servers, tempfile.TemporaryDirectory(prefix="checkpoint-stall-", dir=shm) as tier:
        for server, name in servers:
            uri = f"{server.scheme}://{server.new_bucket()}/run"
            memory = os.path.join(tier, server.scheme)
            with CheckpointStore(uri, memory_tier=memory, **server.store_kwargs) as store:
                store.save(step, state, {"step": step}, blocking=True)
                if store.wait() is None:
                    raise SystemExit(f"the save to {uri} did not commit; see the log above")
            for repeat in range(repeats):
                storage_label = {"GCS": "GCS emulator", "S3": "S3 on moto", "file": "file on disk"}[name]
                seconds.setdefault(f"{FSSPEC_READ}{storage_label}", []).append(fsspec_read_seconds(server, uri, step))
                new_pod = os.path.join(tier, f"{server.scheme}-new-pod-{repeat}")  # a memory tier, empty
                for label, tier_dir, read_from in (
                    (storage_label, new_pod, "storage"),
                    (f"memory ({name} listing)", memory, "memory"),
                ):
                    target, digest = fresh_state()
                    began = time.perf_counter()
                    with CheckpointStore(uri, memory_tier=tier_dir, **server.store_kwargs) as store:
                        store.load(store.latest_valid(), target)
                        read = store.metrics.last_restore_source
                    seconds.setdefault(label, []).append(time.perf_counter() - began)
                    shutil.rmtree(new_pod, ignore_errors=True)
                    if read_from == "memory":
                        seconds.setdefault(COPY_FLOOR, []).append(copy_floor_seconds(memory, step))
                    if read != read_from or digest(target) != expected:
                        raise SystemExit(
                            f"restore '{label}' read from {read} (expected {read_from}) or restored other "
                            "weights than were saved"
                        )
    return seconds


#: Label prefix of the reference reads in `measure_restores`: fsspec alone reading the files a restore reads.
FSSPEC_READ = "fsspec reads the same files: "
#: Label of the memory restore's floor in `measure_restores`: copying the bytes alone (`copy_floor_seconds`).
COPY_FLOOR = "copy floor: the tier's data files into memory already touched"


def copy_floor_seconds(tier: str, step: int) -> float:
    """Seconds to copy the data files of `step` in the memory tier `tier` into memory already touched (as a restore
    copies into a built model's tensors), each file in `READ_THREADS` contiguous parts at once, 1 MiB reads: what a
    memory restore cannot go below on this machine (no listing, metadata, checks or placing into tensors)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from trainingrun_trainer.checkpoint.tensor_files import READ_THREADS

    files = sorted(Path(tier).glob(f"step-{step:08d}/*.distcp"))
    if not files:
        raise SystemExit(f"no data files of step {step} in {tier}")
    buffers = [np.ones(path.stat().st_size, dtype=np.uint8) for path in files]  # touched: no page faults timed

    def copy(fd: int, view: memoryview, start: int, end: int) -> None:
        for offset in range(start, end, 1 << 20):
            os.preadv(fd, [view[offset : min(end, offset + (1 << 20))]], offset)

    began = time.perf_counter()
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for path, buffer in zip(files, buffers):
            fd = os.open(path, os.O_RDONLY)
            try:
                view, part = memoryview(buffer), -(-buffer.nbytes // READ_THREADS)
                for done in [
                    pool.submit(copy, fd, view, start, min(buffer.nbytes, start + part))
                    for start in range(0, buffer.nbytes, part)
                ]:
                    done.result()
            finally:
                os.close(fd)
    return time.perf_counter() - began


def fsspec_read_seconds(server, uri: str, step: int) -> float:
    """Seconds fsspec alone takes to read every file of the checkpoint at `step` below `uri`, as a new pod would: a
    filesystem of its own (no cached listing or session), one `find` and one `cat` of every file (gcsfs and s3fs
    fetch them at once). The reference of issue 37's `storage_restore_vs_fsspec`."""
    import fsspec

    cached = getattr(server, "fs", None)  # LocalDisk has none: file://
    fs = (
        fsspec.filesystem("file")
        if cached is None
        else type(cached)(**cached.storage_options, skip_instance_cache=True)
    )
    began = time.perf_counter()
    files = fs.find(f"{uri.split('://', 1)[1]}/step-{step:08d}")
    read = sum(len(data) for data in fs.cat(files).values())
    seconds = time.perf_counter() - began
    if not files or read == 0:
        raise SystemExit(f"fsspec found nothing to read at step {step} below {uri}")
    return seconds


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have been busy (Linux /proc/stat); NaN elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, idle, iowait, irq, softirq = (fields + [0] * 7)[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread (Linux /proc/<pid>[/task/<tid>]/stat); NaN elsewhere."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def background_cpu_seconds(store) -> float:
    """CPU seconds the store's background work has used: its checkpoint and persister threads."""
    threads = list(getattr(store.saver.executor, "_threads", ())) + list(getattr(store.persister._pool, "_threads", ()))
    return sum(cpu_seconds(f"/proc/self/task/{thread.native_id}/stat") for thread in threads)


#: Rows of the store that commits in the memory tier and persists behind (CheckpointStore(persist_behind=True)).
PERSIST_BEHIND = " [persist behind]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Target: blocking_ratio = async save() blocking / torch.save <= 0.10.",
    )
    parser.add_argument("--dim", type=int, default=768, help="CharTransformer width (default 768)")
    parser.add_argument("--layers", type=int, default=3, help="transformer blocks (default 3)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    parser.add_argument("--context", type=int, default=64, help="context length (default 64)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per training step (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="saves per method; medians reported (default 5)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model trains; staging copies it to CPU (default cpu)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads; 0 leaves torch's default (default 0)"
    )
    parser.add_argument(
        "--dir", default=None, help="parent directory of the temp checkpoint dir (default: system temp)"
    )
    parser.add_argument(
        "--max-overlap-steps",
        type=int,
        default=6,
        help="training steps run at most while one background write is in flight (default 6)",
    )
    parser.add_argument(
        "--writer-nice",
        type=int,
        default=0,
        help="experiment: nice value for the store's background writer thread (Linux); "
        "0 leaves it as the library does (default 0)",
    )
    parser.add_argument(
        "--copy-on-training-thread",
        action="store_true",
        help="experiment: stage every tensor inside save() on the training thread (no copy_in_background), "
        "as the trainer did before",
    )
    parser.add_argument(
        "--restore-repeats",
        type=int,
        default=3,
        help="restores per source (GCS emulator, moto, memory tier); medians reported (default 3); 0: none",
    )
    parser.add_argument(
        "--restore-from",
        choices=["servers", "file"],
        default="servers",
        help="storage the restores read: the GCS emulator and moto's S3 server (default), or file:// on "
        "this machine's disk (where the emulators are not installed, e.g. a GPU machine)",
    )
    parser.add_argument(
        "--min-state-mb", type=float, default=200.0, help="refuse to run with a smaller state (default 200)"
    )
    args = parser.parse_args(argv)

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainingrun_trainer.checkpoint import CheckpointStore, model_digest
    from trainingrun_trainer.checkpoint.saving import tensor_bytes
    from trainingrun_trainer.checkpoint.storage import FETCH_AHEAD
    from trainingrun_trainer.checkpoint.tensor_files import READ_THREADS
    from trainingrun_trainer.data import SyntheticText
    from trainingrun_trainer.models import CharTransformer
    from trainingrun_trainer.seeding import rng_state
    from trainingrun_trainer.state import CHANGED_BY_OPTIMIZER_STEP, ModelState, OptimizerState

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def build(seed: int):
        torch.manual_seed(seed)
        model = CharTransformer(
            vocab_size=128, dim=args.dim, layers=args.layers, heads=args.heads, context_length=args.context
        ).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
        return model, optimizer

    dataset = SyntheticText(num_samples=1000, context_length=args.context, vocab_size=128, seed=0)
    batches = [
        {"tokens": torch.stack([dataset[i * args.batch_size + j]["tokens"] for j in range(args.batch_size)]).to(device)}
        for i in range(8)
    ]
    model, optimizer = build(0)
    step_no = 0

    copy_waits: list[float] = []  # per training step: waiting for a save's background copy (as the trainer does)

    def train_step(saving=None) -> float:
        """One training step; with `saving` (a store with a save in flight), it waits for the save's background copy
        of the weights before the optimizer step changes them, as the trainer does."""
        nonlocal step_no
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(batches[step_no % len(batches)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        copy_waits.append(saving.wait_copied() if saving is not None else 0.0)
        optimizer.step()
        sync()
        step_no += 1
        return time.perf_counter() - began

    for _ in range(2):  # warm up kernels and create AdamW's moments
        train_step()

    def state_now() -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    state = state_now()
    state_bytes = tensor_bytes(state)
    state_mb = state_bytes / 1e6
    params = sum(p.numel() for p in model.parameters())
    if state_mb < args.min_state_mb:
        parser.error(f"state is {state_mb:.0f} MB (< --min-state-mb {args.min_state_mb:.0f}); raise --dim/--layers")

    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    def async_save(on, suffix: str, extra: dict, baseline: float):
        """What Trainer._save does on the training thread (Stateful entries, the digest left to the background), then
        real training steps while the write runs, until it has committed. Returns the committed checkpoint."""
        cpu_before = background_cpu_seconds(on)
        t = time.perf_counter()
        trainer_state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
        pending = on.save(
            step_no,
            trainer_state,
            extra,
            model_digest=lambda staged: model_digest(staged["model"]),
            blocking=False,
            copy_in_background=() if args.copy_on_training_thread else CHANGED_BY_OPTIMIZER_STEP,
        )
        save_call = time.perf_counter() - t
        record("async store.save() call (wall)" + suffix, save_call)
        in_flight_at_step_start = not pending.done()
        overlap_steps = []
        while not overlap_steps or (not pending.done() and len(overlap_steps) < args.max_overlap_steps):
            overlap_steps.append(train_step(saving=on))
            if len(overlap_steps) == 1:
                in_flight_at_step_end = not pending.done()
                record("  + waiting for the background copy before the optimizer step" + suffix, copy_waits[-1])
                record("trainer save path: save() + that wait" + suffix, save_call + copy_waits[-1])
                record("  PendingSave.blocking_seconds" + suffix, pending.blocking_seconds)
        record("training step during background write" + suffix, overlap_steps[0])
        if not suffix:
            overlapped.append((in_flight_at_step_start, in_flight_at_step_end))
            overlap_counts.append(len(overlap_steps))
        slowdown = sum(max(0.0, s - baseline) for s in overlap_steps)
        record("  extra step time while the write ran (all steps)" + suffix, slowdown)
        record("effective stall: save() + extra step time" + suffix, save_call + slowdown)
        committed = on.wait()
        if committed is None:
            raise SystemExit(f"async save of step {pending.step} did not commit; see the log above")
        record("save-to-commit (store.metrics.last_save_seconds)" + suffix, on.metrics.last_save_seconds)
        for phase, seconds in on.metrics.last_save_phases.items():
            phases.setdefault(suffix, {}).setdefault(phase, []).append(seconds)
        if on.persist_behind:
            if on.flush() != committed:
                raise SystemExit(f"step {pending.step} was committed in memory but not persisted; see the log above")
            record(
                "  then persisted to storage (store.metrics.last_persist_seconds)" + suffix,
                on.metrics.last_persist_seconds,
            )
        record(
            "  CPU seconds of the background work (checkpoint thread)" + suffix, background_cpu_seconds(on) - cpu_before
        )
        return committed

    phases: dict[str, dict[str, list]] = {}  # suffix -> phase -> seconds, per repeat (store.metrics.last_save_phases)
    overlap_counts = []  # training steps run while a background write was in flight
    foreign = []  # CPU cores other processes on the machine used during each repeat
    overlapped = []  # was the background write still running when the next step started / ended?
    restored_ok = []
    began_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-", dir=args.dir) as tmp:
        root = Path(tmp)
        store = CheckpointStore((root / "store").resolve().as_uri(), keep=2)
        sync_store = CheckpointStore((root / "sync-store").resolve().as_uri(), keep=2)
        # The memory tier in node memory, as in a pod.
        tier = Path(
            tempfile.mkdtemp(prefix="checkpoint-stall-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else root)
        )
        behind_store = CheckpointStore(
            (root / "behind-store").resolve().as_uri(), keep=2, memory_tier=str(tier), persist_behind=True
        )
        if args.writer_nice:
            # Experiment, not what the library does: lower the priority of the store's background
            # thread (Linux: a thread is a task with its own nice value).
            import threading

            store.saver.executor.submit(
                lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.writer_nice)
            ).result()
        # Warm-up, untimed: first use of the store, the allocator and fresh page-cache pages, as the trainer's first save
        # (persisting behind, the spare in memory that the persister prepares after it).
        warm = state_now()
        for warming in (store, behind_store):
            warming.save(
                step_no,
                {"model": ModelState(model), "optim": OptimizerState(model, optimizer)},
                {"step": step_no},
                blocking=False,
                copy_in_background=CHANGED_BY_OPTIMIZER_STEP,
            )
            warming.wait()
            warming.flush()
        torch.save(warm, root / "warm-up.pt")
        (root / "warm-up.pt").unlink()
        del warm
        for repeat in range(args.repeats):
            machine_before, ours_before, wall_before = machine_busy_seconds(), time.process_time(), time.perf_counter()
            baseline = statistics.median([train_step() for _ in range(2)])
            record("training step, no save in flight", baseline)
            extra = {"step": step_no, "rng": rng_state(), "sampler": {"epoch": 0, "consumed": step_no * 4}}

            digest = model_digest(state_now()["model"])  # for the restore check: the weights at save() time
            info = async_save(store, "", extra, baseline)
            async_save(behind_store, PERSIST_BEHIND, extra, baseline)

            # Synchronous baselines, same state, same disk: torch.save into new files that are kept,
            # as checkpoints are. Two per repeat, the faster one counts: on VMs that hand free memory
            # back to the host (the 2-core dev VM), writing into first-touched page-cache memory is
            # several times slower at random, which would otherwise decide the ratio.
            state = state_now()
            writes = []
            for attempt in range(2):
                candidate = root / f"torch-save-{repeat}-{attempt}.pt"
                t, cpu = time.perf_counter(), time.thread_time()
                torch.save(state, candidate)
                writes.append((time.perf_counter() - t, candidate, time.thread_time() - cpu))
            writes.sort()
            path = writes[0][1]
            record("sync torch.save (new file, faster of 2)", writes[0][0])
            record("  its CPU seconds", writes[0][2])
            record("  the slower of the 2", writes[1][0])
            t = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            record("  + os.fsync of that file", time.perf_counter() - t)
            rows.setdefault("sync torch.save + fsync", []).append(
                rows["sync torch.save (new file, faster of 2)"][-1] + rows["  + os.fsync of that file"][-1]
            )
            t = time.perf_counter()
            sync_store.save(step_no, state_now(), extra, model_digest=digest, blocking=True)
            record("sync store.save(blocking=True)", time.perf_counter() - t)
            if sync_store.wait() is None:
                raise SystemExit("blocking save did not commit; see the log above")

            # Restore into a fresh model + optimizer, as the trainer resumes.
            fresh_model, fresh_optimizer = build(1000 + repeat)
            model_state, optim_state = get_state_dict(fresh_model, fresh_optimizer)  # initialises AdamW state
            fresh = {"model": model_state, "optim": optim_state}
            t = time.perf_counter()
            store.load(info, fresh)
            record("CheckpointStore.load (restore)", time.perf_counter() - t)
            t = time.perf_counter()
            set_state_dict(
                fresh_model, fresh_optimizer, model_state_dict=fresh["model"], optim_state_dict=fresh["optim"]
            )
            record("  + set_state_dict", time.perf_counter() - t)
            restored_ok.append(model_digest(get_state_dict(fresh_model, fresh_optimizer)[0]) == digest)

            t = time.perf_counter()
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            record("torch.load", time.perf_counter() - t)
            fresh_model, fresh_optimizer = build(2000 + repeat)
            get_state_dict(fresh_model, fresh_optimizer)
            t = time.perf_counter()
            set_state_dict(
                fresh_model, fresh_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
            )
            record("  + set_state_dict ", time.perf_counter() - t)
            del loaded, fresh_model, fresh_optimizer, fresh

            t = time.perf_counter()
            latest = store.latest_valid()
            record("resume: latest_valid() (re-hash every file)", time.perf_counter() - t)
            if latest is None or latest.step != info.step:
                raise SystemExit(f"latest_valid() found {latest}, expected step {info.step}")
            machine_after = machine_busy_seconds()
            foreign.append(
                max(0.0, (machine_after - machine_before) - (time.process_time() - ours_before))
                / (time.perf_counter() - wall_before)
            )
            print(
                f"  repeat {repeat + 1}: save() blocked {rows['async store.save() call (wall)'][-1]:.3f} s, torch.save "
                f"{rows['sync torch.save (new file, faster of 2)'][-1]:.3f} s, commit after "
                f"{store.metrics.last_save_seconds:.3f} s, restore {rows['CheckpointStore.load (restore)'][-1]:.3f} s; "
                f"other processes used {foreign[-1]:.2f} cores",
                flush=True,
            )
        store.close()
        sync_store.close()
        behind_store.close()
        shutil.rmtree(tier, ignore_errors=True)

    def fresh_state():
        fresh_model, fresh_optimizer = build(3000)
        model_state, optim_state = get_state_dict(fresh_model, fresh_optimizer)  # initialises AdamW state
        return {"model": model_state, "optim": optim_state}, lambda loaded: model_digest(loaded["model"])

    restores = (
        measure_restores(
            state_now(),
            step_no,
            fresh_state,
            lambda saved: model_digest(saved["model"]),
            args.restore_repeats,
            args.restore_from,
        )
        if args.restore_repeats
        else {}
    )
    total = time.perf_counter() - began_all

    med = {name: statistics.median(values) for name, values in rows.items()}
    sync_save = med["sync torch.save (new file, faster of 2)"]
    print()
    print(
        f"state: CharTransformer dim={args.dim} layers={args.layers} heads={args.heads} context={args.context} "
        f"({params / 1e6:.1f} M parameters) + AdamW moments = {state_mb:.0f} MB of tensors; device {args.device}, "
        f"torch threads {torch.get_num_threads()}{f'; writer thread nice {args.writer_nice}' if args.writer_nice else ''}; {args.repeats} repeats, medians; dir {args.dir or tempfile.gettempdir()}; "
        f"benchmark {total:.0f} s"
    )
    print()
    runs_header = "  ".join(f"{'run ' + str(i + 1):>7}" for i in range(args.repeats))
    header = f"{'what':<68}{runs_header}  {'median s':>9}  {'vs torch.save':>13}  {'MB/s':>7}"
    print(header)
    print("-" * len(header))
    async_rows = [
        "async store.save() call (wall)",
        "  + waiting for the background copy before the optimizer step",
        "trainer save path: save() + that wait",
        "  PendingSave.blocking_seconds",
        "training step during background write",
        "  extra step time while the write ran (all steps)",
        "effective stall: save() + extra step time",
        "save-to-commit (store.metrics.last_save_seconds)",
        "  CPU seconds of the background work (checkpoint thread)",
    ]
    order = [
        "training step, no save in flight",
        *async_rows,
        *(name + PERSIST_BEHIND for name in async_rows[:-1]),
        "  then persisted to storage (store.metrics.last_persist_seconds)" + PERSIST_BEHIND,
        async_rows[-1] + PERSIST_BEHIND,
        "sync torch.save (new file, faster of 2)",
        "  its CPU seconds",
        "  + os.fsync of that file",
        "sync torch.save + fsync",
        "  the slower of the 2",
        "sync store.save(blocking=True)",
        "CheckpointStore.load (restore)",
        "  + set_state_dict",
        "torch.load",
        "  + set_state_dict ",
        "resume: latest_valid() (re-hash every file)",
    ]
    throughput_rows = {
        "async store.save() call (wall)",
        "save-to-commit (store.metrics.last_save_seconds)",
        "sync torch.save (new file, faster of 2)",
        "sync torch.save + fsync",
        "sync store.save(blocking=True)",
        "CheckpointStore.load (restore)",
        "torch.load",
        "resume: latest_valid() (re-hash every file)",
    }
    for name in order:
        values = rows[name]
        cells = "  ".join(f"{v:7.3f}" for v in values)
        rate = f"{state_mb / med[name]:7.0f}" if name in throughput_rows and med[name] > 0 else f"{'':>7}"
        print(f"{name:<68}{cells}  {med[name]:9.3f}  {med[name] / sync_save:13.3f}  {rate}")
    print()

    blocking = med["async store.save() call (wall)"]
    ratio = blocking / sync_save

    def per_repeat(name: str) -> tuple[float, float, float]:
        """Median, min and max over the repeats of `name` / that repeat's torch.save."""
        ratios = [a / b for a, b in zip(rows[name], rows["sync torch.save (new file, faster of 2)"])]
        return statistics.median(ratios), min(ratios), max(ratios)

    trainer_ratio, trainer_low, trainer_high = per_repeat("trainer save path: save() + that wait")
    stall_ratio, stall_low, stall_high = per_repeat("effective stall: save() + extra step time")
    trainer_blocking = med["trainer save path: save() + that wait"]
    restore = med["CheckpointStore.load (restore)"]
    step_base = med["training step, no save in flight"]
    step_during = med["training step during background write"]
    began_in_flight = sum(start for start, _ in overlapped)
    ended_in_flight = sum(end for _, end in overlapped)
    effective = med["effective stall: save() + extra step time"]
    print(
        f"overlap: the background write was still in flight when the next training step began in "
        f"{began_in_flight}/{len(overlapped)} repeats and when it ended in {ended_in_flight}/{len(overlapped)}; "
        f"that step took {step_during:.3f} s vs {step_base:.3f} s with no save in flight "
        f"({step_during / step_base:.2f}x); steps run before the commit: {overlap_counts}"
    )
    print(
        f"effective stall (save() blocking + the extra time of the steps that ran beside the write): "
        f"{effective:.3f} s = {effective / sync_save:.3f} x torch.save"
    )
    print(
        f"consistency: restored weights equal the weights at save() time (not the step after) in "
        f"{sum(restored_ok)}/{len(restored_ok)} repeats"
    )
    print(
        f"blocking_ratio = save() blocking / torch.save = {blocking:.3f} / {sync_save:.3f} = {ratio:.3f} "
        f"(target <= 0.10: {'met' if ratio <= 0.10 else 'NOT met'})"
    )
    slow = med["  the slower of the 2"]
    print(f"  (against the slower torch.save of each repeat, {slow:.3f} s: {blocking / slow:.3f})")
    print(
        f"per repeat, median (min-max) over {args.repeats}: trainer's save path on the training thread "
        f"{trainer_ratio:.3f} ({trainer_low:.3f}-{trainer_high:.3f}) x torch.save (target <= 0.05: "
        f"{'met' if trainer_ratio <= 0.05 else 'NOT met'}); effective stall {stall_ratio:.3f} ({stall_low:.3f}-"
        f"{stall_high:.3f}) x torch.save (target <= 0.5: {'met' if stall_ratio <= 0.5 else 'NOT met'})"
    )
    commit = per_repeat("save-to-commit (store.metrics.last_save_seconds)")
    commit_behind = per_repeat("save-to-commit (store.metrics.last_save_seconds)" + PERSIST_BEHIND)
    persist_behind = per_repeat("  then persisted to storage (store.metrics.last_persist_seconds)" + PERSIST_BEHIND)
    behind_cpu = med["  CPU seconds of the background work (checkpoint thread)" + PERSIST_BEHIND]
    print(
        f"commit_vs_torch_save = save() to committed / torch.save, per repeat: committed to storage {commit[0]:.3f} "
        f"({commit[1]:.3f}-{commit[2]:.3f}) (issue 37's target for the memory tier: <= 0.5)"
    )
    print(
        f"  persisting behind (committed in the memory tier): {commit_behind[0]:.3f} ({commit_behind[1]:.3f}-{commit_behind[2]:.3f}) x torch.save (target <= 0.5: "
        f"{'met' if commit_behind[0] <= 0.5 else 'NOT met'}); then persisted to storage in {persist_behind[0]:.3f} "
        f"({persist_behind[1]:.3f}-{persist_behind[2]:.3f}) x torch.save more; CPU of both tiers "
        f"{behind_cpu / med['  its CPU seconds']:.2f}x torch.save's (target <= 1.5)"
    )
    for suffix, label in (
        ("", "committed to storage"),
        (PERSIST_BEHIND, "persisting behind"),
    ):
        if phases.get(suffix):
            print(
                f"where save-to-commit went ({label}; medians, store.metrics.last_save_phases): "
                + ", ".join(f"{phase} {statistics.median(values):.3f} s" for phase, values in phases[suffix].items())
            )
    background_cpu = med["  CPU seconds of the background work (checkpoint thread)"]
    save_cpu = med["  its CPU seconds"]
    print(
        f"CPU of one save's background work (the checkpoint thread: staging, digest, serialising, hashing, writing) "
        f"{background_cpu:.3f} s vs torch.save's {save_cpu:.3f} s = {background_cpu / save_cpu:.2f}x: the steps beside "
        f"the write lose {stall_ratio / (background_cpu / save_cpu):.0%} of it to the effective stall, the rest runs "
        f"in time training leaves idle"
    )
    print(
        f"restore: CheckpointStore.load {restore:.3f} s vs torch.load {med['torch.load']:.3f} s "
        f"({restore / med['torch.load']:.2f}x); resume incl. latest_valid re-hash "
        f"{med['resume: latest_valid() (re-hash every file)'] + restore:.3f} s"
    )
    restore_medians = {label: statistics.median(values) for label, values in restores.items()}
    fsspec_reads = {label.removeprefix(FSSPEC_READ): v for label, v in restore_medians.items() if FSSPEC_READ in label}
    copy_floor = restore_medians.pop(COPY_FLOOR, math.nan)
    restore_medians = {label: v for label, v in restore_medians.items() if FSSPEC_READ not in label}
    from_storage = min((v for label, v in restore_medians.items() if not label.startswith("memory")), default=math.nan)
    # Restoring from storage at the pace fsspec alone reads the same files: >= 0.8 (issue 37); the slowest storage.
    vs_fsspec = {label: fsspec_reads[label] / restore_medians[label] for label in fsspec_reads}
    storage_vs_fsspec = min(vs_fsspec.values(), default=math.nan)
    vs_fsspec_fields = "".join(
        f" storage_restore_vs_fsspec_{label.split()[0].lower()}={ratio:.4f}" for label, ratio in vs_fsspec.items()
    )
    from_memory = max((v for label, v in restore_medians.items() if label.startswith("memory")), default=math.nan)
    memory_speedup = from_storage / from_memory
    memory_vs_load = from_memory / med["torch.load"]
    print(
        f"restore as a restarted process resumes (latest_valid + load into a fresh model), {args.restore_repeats} "
        f"each, median (min-max):"
    )
    for label, values in restores.items():
        if FSSPEC_READ in label or label == COPY_FLOOR:
            continue
        print(
            f"  {'from ' + label:<32}{restore_medians[label]:8.3f} s ({min(values):.3f}-{max(values):.3f})"
            f"{state_mb / restore_medians[label]:8.0f} MB/s"
        )
        if label in fsspec_reads:
            print(
                f"  {'  fsspec alone reads its files':<32}{fsspec_reads[label]:8.3f} s{'':>13}"
                f"{state_mb / fsspec_reads[label]:8.0f} MB/s: the restore runs at "
                f"{fsspec_reads[label] / restore_medians[label]:.2f}x fsspec's pace"
            )
    print(
        f"storage_restore_vs_fsspec = fsspec reading the files / a restore from storage (listing, verify, load), the "
        f"slowest storage = {storage_vs_fsspec:.2f} (issue 37's target: >= 0.8). A restore fetches each file in "
        f"ranges, {FETCH_AHEAD} at once (a new pod waits a round trip per range otherwise); moto answers a range in "
        "time that grows with the whole object's size (8 MiB of a 172 MB object: 0.11 s, of an 8 MB one: 0.02 s), "
        "real S3 and the GCS emulator do not, so S3 on moto understates the restore"
    )
    print(
        f"memory_restore_speedup = the faster storage restore / the slower memory restore = {from_storage:.3f} / "
        f"{from_memory:.3f} = {memory_speedup:.1f}x (target >= 10: {'met' if memory_speedup >= 10 else 'NOT met'})"
    )
    print(
        f"memory_restore_vs_torch_load = the slower memory restore (a new process: listing, verify, load) / torch.load "
        f"= {from_memory:.3f} / {med['torch.load']:.3f} = {memory_vs_load:.2f} (issue 37's target: <= 0.2)"
    )
    print(
        f"  its floor: copying the tier's data files alone into memory already touched ({COPY_FLOOR.split(':')[0]}, "
        f"{READ_THREADS} threads) {copy_floor:.3f} s = {copy_floor / med['torch.load']:.2f} x torch.load; the restore "
        f"takes {from_memory / copy_floor:.2f} x that floor (memory_restore_vs_copy_floor)"
    )
    cores = os.cpu_count() or 1
    if foreign and max(foreign) > 0.1 * cores:
        print(
            f"WARNING: other processes used up to {max(foreign):.2f} of {cores} cores during a repeat "
            f"({', '.join(f'{f:.2f}' for f in foreign)}); the figures include their interference."
        )
    if not all(restored_ok) or began_in_flight == 0:
        print(
            "WARNING: "
            + ("a restore did not reproduce the saved weights; " if not all(restored_ok) else "")
            + ("the background write never overlapped the next step" if began_in_flight == 0 else "")
        )
    print(
        f"result: blocking_ratio={ratio:.4f} async_blocking_seconds={blocking:.4f} sync_save_seconds={sync_save:.4f} "
        f"restore_seconds={restore:.4f} state_mb={state_mb:.1f} background_seconds={med['save-to-commit (store.metrics.last_save_seconds)']:.4f} "
        f"trainer_blocking_seconds={trainer_blocking:.4f} blocking_ratio_vs_slower_save={blocking / slow:.4f} "
        f"effective_stall_seconds={effective:.4f} "
        f"torch_load_seconds={med['torch.load']:.4f} memory_restore_speedup={memory_speedup:.2f} background_cpu_ratio={background_cpu / save_cpu:.2f} "
        f"trainer_blocking_ratio={trainer_ratio:.4f} effective_stall_ratio={stall_ratio:.4f} "
        f"commit_vs_torch_save={commit_behind[0]:.4f} commit_vs_torch_save_to_storage={commit[0]:.4f} "
        f"persist_vs_torch_save={persist_behind[0]:.4f} background_cpu_ratio_persist_behind="
        f"{behind_cpu / med['  its CPU seconds']:.2f} "
        f"memory_restore_vs_torch_load={memory_vs_load:.4f} "
        f"storage_restore_vs_fsspec={storage_vs_fsspec:.4f}{vs_fsspec_fields} "
        f"memory_restore_vs_copy_floor={from_memory / copy_floor:.4f} copy_floor_vs_torch_load="
        f"{copy_floor / med['torch.load']:.4f}"
    )
    return 0 if all(restored_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
