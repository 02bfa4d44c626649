"""Trainer overhead: `python -m trainingrun_trainer` vs a bare hand-written DDP loop.

What is measured
    The wall time of the same training steps done two ways, on the same model
    (`trainingrun_trainer.models.CharTransformer`, default dim 128, 2 layers, 4 heads, context 64,
    about 0.44 M parameters), the same data (`trainingrun_trainer.data.SyntheticText`, read through a
    DataLoader with `num_workers=0` on both sides), the same batch size per rank, the same number of
    steps and the same number of processes (default 2, torchrun + gloo on CPU, nccl on CUDA):

    * bare: a loop written in this file and run under torchrun too: DDP, AdamW (the trainer's
      hyper-parameters and decay groups), the same LR schedule (cosine with linear warmup, a
      LambdaLR), `loss.backward()`, `clip_grad_norm_`, `optimizer.step()`, `scheduler.step()`,
      `zero_grad`, and nothing else (it logs a "step N/M" line every log interval, as the trainer
      does, so both sides are timed the same way).
    * trainer: `python -m torch.distributed.run --standalone --nproc-per-node N -m trainingrun_trainer`
      with a generated config (TRAININGRUN_CONFIG) and a file:// checkpoint store in a temp dir.
      Row "trainer (final save only)": checkpoint interval so large that only the final blocking
      save happens, after the timed window. Row "trainer (async ckpt every K)": periodic async
      checkpoints inside the timed window as well (`--checkpoint-every`, 0 drops the row).
      Row "trainer (ckpt every 2L, paired)" (`--paired`): async checkpoints every 2 x `--log-interval` steps,
      so log windows alternate between one that holds a save (its copy, and its commit behind, when that
      takes less than a window) and one that holds none. Each such pair of neighbouring windows of one
      process gives a ratio, as if every window held a save: a checkpoint every `--log-interval` steps
      against none, with the machine's drift between runs cancelled (it spread whole runs 12-21% on a
      2-core VM, where a 3% target cannot be seen from run medians). `ckpt_paired_overhead_ratio` is the
      median of the pairs' ratios of all runs.
      Row "trainer + metrics": the final-save-only trainer recording its Prometheus metrics (every
      rank writes them, as under the launcher, to PROMETHEUS_MULTIPROC_DIR) while this script reads
      them every second as the launcher's endpoint would for a scrape (`--no-metrics` drops the row).
      Row "trainer + reporting": the final-save-only trainer with rank 0 reporting progress to a report
      endpoint this script serves (HTTP on 127.0.0.1, the contract's protocol and token file) every
      `--report-interval` seconds (default 1, ten times a cluster's rate; `--no-reporting` drops the row).

How
    Process start, imports, model build, rendezvous and the final save are excluded on both
    sides: each side logs "step N/M ..." every `--log-interval` steps with a millisecond
    `%(asctime)s` timestamp (rank 0's lines are parsed), and the figure is the time between the
    logged step `--warmup-steps` (the first window is warm-up and is skipped) and the last logged
    step (`--steps`). OMP_NUM_THREADS is set to `--threads` (default 1) for every process, so 2
    processes on 2 cores do not oversubscribe. Each side runs `--repeats` times (default 3), the
    order of the sides rotating each round so slow drift of the machine hits every side alike;
    the median is reported, with every run's figure beside it.

    The machine may be shared: a sampler reads /proc every 0.25 s and reports, per run and per log
    window, how many cores other processes took ("foreign"). Two figures that such load disturbs
    less come beside the main one: the ms/step of "quiet" log windows only (foreign <= 0.1 cores,
    pooled over runs), and the CPU time all processes of a side spent per step.

Target
    overhead_ratio = trainer_seconds / bare_seconds <= 1.03 (medians, final-save-only trainer row);
    metrics_overhead_ratio = trainer + metrics / trainer <= 1.01.
    reporting_overhead_ratio = trainer + reporting / trainer <= 1.01.
    ckpt_paired_overhead_ratio <= 1.03 (issue 37: a memory checkpoint every 10 steps).
    host_ms_per_step <= 0.2 with `--host-cost` (issue 64): a model whose step computes in about a millisecond, so
    the trainer's per-step Python and host-device synchronisation beyond the bare loop is what remains; each
    round's trainer run minus that round's bare run, per step, median of at least 5 rounds.

Run by hand, never by the test suite:
    /work/venv/bin/python benchmarks/trainer_overhead.py            # defaults: CPU, ~2-3 minutes
    /work/venv/bin/python benchmarks/trainer_overhead.py --device cuda --nproc 8 --dim 1024 \
        --layers 12 --heads 16 --context 256 --batch-size 32 --steps 500 --threads 4
The last line is `result: overhead_ratio=<x> trainer_seconds=<x> bare_seconds=<x> quiet_overhead_ratio=<x>
cpu_overhead_ratio=<x> ckpt_overhead_ratio=<x> ckpt_trainer_seconds=<x> ckpt_paired_overhead_ratio=<x>
metrics_overhead_ratio=<x> reporting_overhead_ratio=<x>` (a row's fields only when it ran; `--paired-only`: only
`ckpt_paired_overhead_ratio`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

STEP_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO [\w.]+: step (?P<step>\d+)/(?P<total>\d+)\b"
)
#: The trainer's own figures: the last window's model FLOP/s and MFU (GPUs with a known peak), and its start-up line.
FLOPS_LINE = re.compile(r"rank0 INFO [\w.]+: step \d+/\d+ .* TFLOP/s (?P<tflops>[0-9.e+-]+)(?: MFU (?P<mfu>[0-9.]+)%)?")
STARTUP_LINE = re.compile(r"rank0 INFO [\w.]+: start-up (?P<seconds>[0-9.]+) s to the first step")
PEAK_LR = 3e-4
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)
EPS = 1e-8
MIN_LR_RATIO = 0.1
CLIP = 1.0


# ------------------------------------------------------------------------------------------------
# The bare loop (runs inside torchrun workers: `trainer_overhead.py --bare-worker SPEC.json`)


def bare_worker(spec_path: str) -> int:
    """DDP + AdamW + LambdaLR cosine + backward + clip + step; nothing else."""
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from trainingrun_trainer.data import SyntheticText
    from trainingrun_trainer.models import CharTransformer

    spec = json.loads(Path(spec_path).read_text())
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s rank{rank} %(levelname)s bench.bare: %(message)s"
    )
    log = logging.getLogger("bench.bare")

    if spec["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if spec["device"] == "cuda" else "gloo")
    torch.manual_seed(spec["seed"])

    model = CharTransformer(
        vocab_size=128, dim=spec["dim"], layers=spec["layers"], heads=spec["heads"], context_length=spec["context"]
    ).to(device)
    # DDP only across processes, as the trainer (compiled, a one-process DDP ran at 54 ms a step against 32 on an H200)
    ddp = (
        nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if spec["device"] == "cuda" else None)
        if world > 1
        else model
    )
    cuda = spec["device"] == "cuda"
    # The trainer's defaults on GPUs (optimizer.fused, trainer.tf32), so both sides run the same settings.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cuda
    if spec.get("compile"):
        ddp = torch.compile(ddp)
    # The trainer's groups: no weight decay for biases, norms and embeddings.
    no_decay_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.LayerNorm, nn.Embedding))
        for p in m.parameters(recurse=False)
    }
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and id(p) not in no_decay_ids]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and id(p) not in no_decay_ids)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=BETAS,
        eps=EPS,
        fused=True,  # the trainer's default (optimizer.fused), GPUs and CPUs
    )
    steps, warmup = spec["steps"], spec["lr_warmup"]

    def lr_factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    dataset = SyntheticText(
        num_samples=spec["num_samples"],
        context_length=spec["context"],
        vocab_size=128,
        seed=spec["seed"],
        split="train",
    )
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=spec["seed"], drop_last=True
    )
    loader = DataLoader(dataset, batch_size=spec["batch_size"], sampler=sampler, drop_last=True, num_workers=0)
    autocast_dtype = torch.bfloat16 if spec["precision"] == "bf16-mixed" else None

    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = ddp(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % spec["log_interval"] == 0 or step == steps:
                log.info("step %d/%d loss %.4f", step, steps, loss.item())  # .item(): same sync point as the trainer
            if step >= steps:
                break
        epoch += 1
    dist.barrier()  # a rank that tore gloo down while its peer still sent aborted the run ("terminate called")
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------
# Driver


class CpuMonitor(threading.Thread):
    """Samples, every `period` seconds, the machine's busy and stolen CPU seconds (/proc/stat) and the
    CPU seconds of the launched process tree (/proc/<pid>/stat), so a run can say how much CPU other
    processes on the machine took during its timed window ("foreign" cores). Linux only; elsewhere
    the figures are NaN."""

    def __init__(self, root_pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.root_pid = root_pid
        self.period = period
        self.samples: list[tuple[float, float, float, float]] = []  # (unix time, busy, steal, ours)
        self._stop_event = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _machine(self) -> tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq) / self._tick, steal / self._tick

    def _ours(self) -> float:
        parents, cpu = {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(rest[1])
            cpu[int(entry)] = (int(rest[11]) + int(rest[12])) / self._tick
        tree = {self.root_pid}
        changed = True
        while changed:
            changed = False
            for pid, ppid in parents.items():
                if ppid in tree and pid not in tree:
                    tree.add(pid)
                    changed = True
        return sum(cpu.get(pid, 0.0) for pid in tree)

    def sample(self) -> None:
        try:
            busy, steal = self._machine()
            self.samples.append((time.time(), busy, steal, self._ours()))
        except (OSError, ValueError, IndexError):
            pass

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def window(self, start: float, end: float) -> dict[str, float]:
        """Figures between the first and the last sample inside [start, end] (unix times; inside,
        so the process tree is complete at both ends): `foreign` and `steal` cores (averages),
        `ours` (CPU seconds of the launched tree) and the sub-window's `begin` and `end` times.
        NaN when fewer than two samples fall inside."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return {"foreign": math.nan, "steal": math.nan, "ours": math.nan, "begin": start, "end": end}
        a, b = inside[0], inside[-1]
        span = b[0] - a[0]
        return {
            "foreign": max(0.0, (b[1] - a[1]) - (b[3] - a[3])) / span,
            "steal": (b[2] - a[2]) / span,
            "ours": b[3] - a[3],
            "begin": a[0],
            "end": b[0],
        }

    def cumulative_at(self, when: float) -> tuple[float, float]:
        """(machine busy, our tree's) CPU seconds at unix time `when`, interpolated between samples."""
        for a, b in zip(self.samples, self.samples[1:]):
            if a[0] <= when <= b[0]:
                f = (when - a[0]) / max(b[0] - a[0], 1e-9)
                return a[1] + f * (b[1] - a[1]), a[3] + f * (b[3] - a[3])
        return math.nan, math.nan

    def foreign_between(self, start: float, end: float) -> float:
        """Cores other processes used between two unix times (interpolated; NaN outside the samples)."""
        (busy0, ours0), (busy1, ours1) = self.cumulative_at(start), self.cumulative_at(end)
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(end - start, 1e-9)


def steps_at(times: dict[int, float], when: float) -> float:
    """Optimizer steps done at unix time `when`, interpolated linearly between logged steps."""
    points = sorted(times.items())
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if t0 <= when <= t1:
            return s0 + (s1 - s0) * (when - t0) / max(t1 - t0, 1e-9)
    return math.nan


def parse_step_times(text: str) -> dict[int, float]:
    """{step: unix time} of rank 0's "step N/M" log lines."""
    out = {}
    for line in text.splitlines():
        match = STEP_LINE.match(line.strip())
        if match:
            stamp = datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out[int(match["step"])] = stamp
    return out


def trainer_config(args: argparse.Namespace, checkpoint_uri: str, checkpoint_every: int) -> dict:
    return {
        "trainer": {
            "model": {
                "classPath": "trainingrun_trainer.models.CharTransformer",
                "initArgs": {
                    "vocabSize": 128,
                    "dim": args.dim,
                    "layers": args.layers,
                    "heads": args.heads,
                    "contextLength": args.context,
                },
            },
            "data": {
                "dataset": {
                    "classPath": "trainingrun_trainer.data.SyntheticText",
                    "initArgs": {"numSamples": args.num_samples, "contextLength": args.context, "vocabSize": 128},
                },
                "batchSize": args.batch_size,
                "numWorkers": 0,
            },
            "optimizer": {
                "name": "adamw",
                "lr": PEAK_LR,
                "weightDecay": WEIGHT_DECAY,
                "beta1": BETAS[0],
                "beta2": BETAS[1],
                "eps": EPS,
                "noDecayForBiasAndNorm": True,
                "fused": True,  # the default now; said, so a --baseline checkout of older code runs the same kernel
            },
            "schedule": {"name": "cosine", "warmupSteps": args.lr_warmup, "minLrRatio": MIN_LR_RATIO},
            "maxSteps": args.steps,
            "gradClipNorm": CLIP,
            "precision": args.precision,
            "compile": args.compile,
            "seed": args.seed,
            "logIntervalSteps": args.log_interval,
        },
        "checkpoint": {"uri": checkpoint_uri, "interval": {"steps": checkpoint_every}, "keep": 2, "asyncSave": True},
    }


class Scraper(threading.Thread):
    """Reads every rank's metrics files once a second, as the launcher's /metrics does for Prometheus."""

    def __init__(self, directory: Path):
        super().__init__(daemon=True)
        self.directory, self.last, self._done = directory, "", threading.Event()
        self.start()

    def run(self) -> None:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.directory))
        while not self._done.wait(1.0):
            self.last = generate_latest(registry).decode()

    def stop(self) -> None:
        self._done.set()
        self.join()


class ReportSink:
    """A report endpoint on 127.0.0.1 that takes every report (200) and counts them."""

    def __init__(self, token: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.received = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ok = self.headers.get("Authorization") == f"Bearer {token}"
                sink.received += ok
                self.send_response(200 if ok else 401)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def simulated_nodes(
    launcher: list[str], command: list[str], env: dict[str, str], rundir: Path, nodes: int
) -> list[tuple[list[str], dict[str, str]]]:
    """(command, environment) of each launcher: one (`--standalone`), or with `--nodes N` one per simulated node as
    `trainingrun local --nodes` starts them (c10d rendezvous hosted by node 0 on 127.0.0.1; each node its own memory
    folder, the pod's /dev/shm, in a folder of /dev/shm where there is one, and its own pod name)."""
    if nodes == 1:
        return [(command, env)]
    from trainingrun_api import contract
    from trainingrun_operator.local.runner import _free_port, node_rendezvous

    port = _free_port()

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else rundir
    launches = []
    for node in range(nodes):
        memory = Path(tempfile.mkdtemp(prefix=f"trainer-overhead-node-{node}-", dir=shm))
        (rundir / f"node-{node}-memory").symlink_to(memory)  # removed with the run (`run_side`)
        rendezvous = node_rendezvous(nodes, node, port, rundir.name)
        node_env = {**env, contract.MEMORY_TIER_ROOT_ENV: str(memory), contract.POD_NAME: f"bench-worker-{node}"}
        launches.append(([*launcher[:3], *rendezvous, *launcher[4:], *command[len(launcher) :]], node_env))
    return launches


def run_side(kind: str, args: argparse.Namespace, workdir: Path, run_id: str) -> dict:
    """One torchrun launch; returns {'seconds', 'wall', 'steps'} of the timed window."""
    import yaml

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "TRAININGRUN_", "PET_"))}
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer picks cuda whenever it sees one
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    rundir = workdir / run_id
    rundir.mkdir()
    if kind == "bare":
        spec = {
            "device": args.device,
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "context": args.context,
            "batch_size": args.batch_size,
            "num_samples": args.num_samples,
            "steps": args.steps,
            "lr_warmup": args.lr_warmup,
            "log_interval": args.log_interval,
            "seed": args.seed,
            "precision": args.precision,
            "compile": args.compile,
        }
        (rundir / "spec.json").write_text(json.dumps(spec))
        command = launcher + [str(Path(__file__).resolve()), "--bare-worker", str(rundir / "spec.json")]
    else:
        every = {"trainer-ckpt": args.checkpoint_every, "trainer-paired": 2 * args.log_interval}.get(kind, 10**9)
        config = trainer_config(args, (rundir / "ckpt").resolve().as_uri(), every)
        (rundir / "config.yaml").write_text(yaml.safe_dump(config))
        env.update({"TRAININGRUN_CONFIG": str(rundir / "config.yaml"), "TRAININGRUN_NAME": "bench"})
        if kind == "trainer-metrics":
            (rundir / "metrics").mkdir()
            env["PROMETHEUS_MULTIPROC_DIR"] = str(rundir / "metrics")
        if kind == "trainer-reporting":
            from trainingrun_api import contract

            sink = ReportSink("bench-token")
            (rundir / "token").write_text("bench-token")
            env.update(
                {
                    contract.REPORT_URL: f"http://127.0.0.1:{sink.server.server_address[1]}{contract.REPORT_PATH}",
                    contract.REPORT_TOKEN_FILE: str(rundir / "token"),
                    contract.REPORT_INTERVAL_SECONDS: str(args.report_interval),
                }
            )
        if kind == "trainer-baseline":  # the same trainer from another checkout (`--baseline`)
            tree = Path(args.baseline).resolve()
            env["PYTHONPATH"] = os.pathsep.join(str(tree / part) for part in ("trainer_image", "common"))
        command = launcher + ["-m", "trainingrun_trainer"]
    began = time.perf_counter()
    log_path = rundir / "output.log"
    launches = simulated_nodes(launcher, command, env, rundir, args.nodes)
    others: list[subprocess.Popen] = []
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            launches[0][0], env=launches[0][1], cwd=rundir, stdout=log_file, stderr=subprocess.STDOUT, text=True
        )
        for node, (node_command, node_env) in enumerate(launches[1:], start=1):
            with open(rundir / f"output-node-{node}.log", "w") as node_log:
                others.append(
                    subprocess.Popen(
                        node_command, env=node_env, cwd=rundir, stdout=node_log, stderr=subprocess.STDOUT, text=True
                    )
                )
        monitor = CpuMonitor(proc.pid, period=0.25)
        monitor.start()
        scraper = Scraper(rundir / "metrics") if kind == "trainer-metrics" else None
        try:
            returncode = proc.wait(timeout=args.timeout)
            returncode = returncode or max((other.wait(timeout=args.timeout) for other in others), default=0)
        except subprocess.TimeoutExpired:
            for launched in (proc, *others):
                launched.kill()
                launched.wait()
            raise SystemExit(
                f"{kind} run {run_id} took longer than --timeout {args.timeout:.0f} s; log {log_path}"
            ) from None
        finally:
            monitor.stop()
            if scraper:
                scraper.stop()
            if kind == "trainer-reporting":
                sink.stop()
            for other in others:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            for memory in rundir.glob("node-*-memory"):  # each simulated node's memory went with its pod
                shutil.rmtree(memory.resolve(), ignore_errors=True)
                memory.unlink()
    wall = time.perf_counter() - began
    output = log_path.read_text()
    if scraper and "trainingrun_step" not in scraper.last:
        raise SystemExit(f"{kind} run {run_id}: the metrics files had no trainingrun_step series")
    if kind == "trainer-reporting" and sink.received < 2:
        raise SystemExit(f"{kind} run {run_id}: the report endpoint got {sink.received} reports")
    if returncode != 0:
        tail = "\n".join(output.splitlines()[-30:])
        raise SystemExit(f"{kind} run {run_id} exited {returncode}; log {log_path}:\n{tail}")
    times = parse_step_times(output)
    start, end = args.warmup_steps, args.steps
    if start not in times or end not in times:
        raise SystemExit(
            f"{kind} run {run_id}: no 'step {start}/..' or 'step {end}/..' line from rank 0 "
            f"(found steps {sorted(times)}); log {rundir / 'output.log'}"
        )
    window = monitor.window(times[start], times[end])
    steps_sampled = steps_at(times, window["end"]) - steps_at(times, window["begin"])
    # CPU seconds of all processes of this side per optimizer step: the work done, which contention
    # from other processes on the machine changes far less than it changes wall time.
    cpu_ms = 1000 * window["ours"] / steps_sampled if steps_sampled > 0 else math.nan
    # Each logged window (log-interval steps) with the CPU other processes took during it, so windows
    # that other load disturbed can be told from quiet ones.
    logged = sorted(step for step in times if start <= step <= end)
    windows = [
        (b - a, times[b] - times[a], monitor.foreign_between(times[a], times[b])) for a, b in zip(logged, logged[1:])
    ]
    # The paired row's windows from a multiple of its checkpoint interval hold its save (it comes after the log line).
    cycle = 2 * args.log_interval
    pair_ratios = [
        (times[a + args.log_interval] - times[a]) / (times[a + cycle] - times[a + args.log_interval])
        for a in logged
        if a % cycle == 0 and a + cycle <= end
    ]
    flops = FLOPS_LINE.findall(output)
    startup = STARTUP_LINE.search(output)
    return {
        "seconds": times[end] - times[start],
        "wall": wall,
        "steps": end - start,
        "foreign": window["foreign"],
        "steal": window["steal"],
        "cpu_ms": cpu_ms,
        "windows": windows,
        "pair_ratios": pair_ratios,
        "tflops": float(flops[-1][0]) if flops else math.nan,
        "mfu": float(flops[-1][1]) / 100 if flops and flops[-1][1] else math.nan,
        "startup": float(startup["seconds"]) if startup else math.nan,
    }


def paired_summary(runs: list[dict], log_interval: int) -> tuple[str, str]:
    """The paired row's line for people and its `result:` field, from the pairs of all its runs pooled (one run's
    median moves by several percent on a shared machine)."""
    pairs = sorted(p for r in runs for p in r["pair_ratios"])
    ratio = statistics.median(pairs)
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [ratio] * 3
    runs_text = ", ".join(f"{statistics.median(r['pair_ratios']):.3f}" for r in runs if r["pair_ratios"])
    text = (
        f"ckpt_paired_overhead_ratio = a log window with a save / the next without, as if every "
        f"{log_interval} steps saved = {ratio:.4f} (median of {len(pairs)} pairs, quartiles "
        f"{quartiles[0]:.4f}-{quartiles[2]:.4f}; run medians {runs_text}; target <= 1.03: "
        f"{'met' if ratio <= 1.03 else 'NOT met'})"
    )
    return text, f" ckpt_paired_overhead_ratio={ratio:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Target: overhead_ratio = trainer / bare <= 1.03.",
    )
    parser.add_argument("--bare-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes per side, torchrun --nproc-per-node (default 2)"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (gloo) or cuda (nccl, one GPU per process) (default cpu)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="simulated nodes per side, each a launcher of --nproc processes with a memory folder of its own, as "
        "`trainingrun local --nodes` (default 1: one standalone launcher); compare --paired-only --nodes 2 --nproc 1 "
        "with --nproc 2 for issue 63's two-pod step-rate cost",
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (default 1)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--context", type=int, default=64, help="context length in tokens (default 64)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per process per step (default 16)")
    parser.add_argument("--num-samples", type=int, default=10000, help="SyntheticText samples (default 10000)")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per run (default 160)")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between log lines (default 10)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=20,
        help="timing starts at this logged step; a multiple of --log-interval (default 20)",
    )
    parser.add_argument("--lr-warmup", type=int, default=10, help="linear LR warmup steps of the schedule (default 10)")
    parser.add_argument(
        "--precision",
        choices=["32-true", "bf16-mixed"],
        default="32-true",
        help="precision on both sides (default 32-true)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model on both sides")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between async checkpoints in the extra trainer row; 0 drops it (default 50)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="add the row that alternates log windows with and without a save (ckpt_paired_overhead_ratio)",
    )
    parser.add_argument(
        "--paired-only",
        action="store_true",
        help="run the paired row alone (an A/B of checkpoint code: run it with each side's PYTHONPATH in turn)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="drop the trainer + metrics row")
    parser.add_argument("--no-reporting", action="store_true", help="drop the trainer + reporting row")
    parser.add_argument(
        "--report-interval",
        type=float,
        default=1.0,
        help="seconds between rank 0's reports in the reporting row (default 1; 10 in a cluster)",
    )
    parser.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.1,
        help="a log window counts as quiet when other processes took at most this many cores "
        "(default 0.1); the quiet-window figures use only those",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, rotating order (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both sides (default 0)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one launch may take (default 600)")
    parser.add_argument(
        "--keep", metavar="DIR", help="write configs and logs of every run below DIR (default: temp dir, deleted)"
    )
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the trainer from another checkout of this repository (e.g. `git worktree add /tmp/before "
        "HEAD~3`), imported from its trainer_image/ and common/, to print its host cost beside this one's",
    )
    parser.add_argument(
        "--host-cost",
        action="store_true",
        help="the host-cost row (issue 64): a model so small its step computes in about a millisecond (dim 32, "
        "1 layer, context 16, batch 4, one process), trainer and bare loop only, at least 5 paired runs",
    )
    args = parser.parse_args(argv)
    if args.host_cost:
        args.dim, args.layers, args.heads, args.context, args.batch_size, args.nproc = 32, 1, 2, 16, 4, 1
        args.repeats, args.checkpoint_every, args.no_metrics, args.no_reporting = max(5, args.repeats), 0, True, True
    if args.bare_worker:
        return bare_worker(args.bare_worker)
    if args.warmup_steps % args.log_interval or not 0 < args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be a positive multiple of --log-interval below --steps")
    if args.steps % args.log_interval:
        parser.error("--steps must be a multiple of --log-interval")

    paired = ("trainer-paired", f"trainer (ckpt every {2 * args.log_interval}, paired)")
    sides = [("bare", "bare DDP loop"), ("trainer", "trainer (final save only)")]
    if args.checkpoint_every:
        sides.append(("trainer-ckpt", f"trainer (async ckpt every {args.checkpoint_every})"))
    if args.paired:
        sides.append(paired)
    if not args.no_metrics:
        sides.append(("trainer-metrics", "trainer + metrics"))
    if not args.no_reporting:
        sides.append(("trainer-reporting", "trainer + reporting"))
    if args.baseline:
        sides.append(("trainer-baseline", "trainer (--baseline checkout)"))
    if args.paired_only:
        sides = [paired]
    results: dict[str, list[dict]] = {kind: [] for kind, _ in sides}

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for round_ in range(args.repeats):
            order = sides[round_ % len(sides) :] + sides[: round_ % len(sides)]
            for kind, _ in order:
                result = run_side(kind, args, workdir, f"r{round_ + 1}-{kind}-{os.getpid()}")
                results[kind].append(result)
                print(
                    f"  round {round_ + 1}: {kind:<17} {result['seconds']:8.3f} s timed "
                    f"({result['wall']:.1f} s with start-up); other processes used "
                    f"{result['foreign']:.2f} cores, hypervisor stole {result['steal']:.2f}; "
                    f"{result['cpu_ms']:.1f} CPU ms/step",
                    flush=True,
                )
    total = time.perf_counter() - began

    if args.paired_only:
        text, extra = paired_summary(results["trainer-paired"], args.log_interval)
        print(f"\n{text}\nbenchmark wall time {total:.0f} s\nresult:{extra}")
        return 0
    timed = args.steps - args.warmup_steps
    medians = {kind: statistics.median(r["seconds"] for r in runs) for kind, runs in results.items()}
    bare = medians["bare"]
    print()
    print(
        f"CharTransformer dim={args.dim} layers={args.layers} heads={args.heads} context={args.context}; "
        f"batch {args.batch_size}/process x {args.nproc} processes ({args.device}, "
        f"{'nccl' if args.device == 'cuda' else 'gloo'}, {args.precision}, OMP_NUM_THREADS={args.threads})"
    )
    print(
        f"timed: steps {args.warmup_steps} -> {args.steps} ({timed} steps) from rank 0's log timestamps; "
        f"{args.repeats} runs per side, order rotating; benchmark wall time {total:.0f} s"
    )
    print()
    runs_header = "  ".join(f"{'run ' + str(i + 1):>8}" for i in range(args.repeats))
    header = (
        f"{'side':<32}{runs_header}  {'median s':>9}  {'min s':>8}  {'spread':>7}  {'steps/s':>8}  "
        f"{'ms/step':>8}  {'vs bare':>8}  {'min vs bare':>11}  {'CPU ms/step':>11}  {'vs bare':>8}  {'foreign':>7}"
    )
    print(header)
    print("-" * len(header))
    best_bare = min(r["seconds"] for r in results["bare"])
    cpu = {kind: statistics.median(r["cpu_ms"] for r in runs) for kind, runs in results.items()}
    worst_foreign = 0.0
    for kind, label in sides:
        runs = [r["seconds"] for r in results[kind]]
        median = medians[kind]
        spread = (max(runs) - min(runs)) / median
        foreign = max(r["foreign"] for r in results[kind])
        worst_foreign = max(worst_foreign, foreign) if not math.isnan(foreign) else worst_foreign
        cells = "  ".join(f"{s:8.3f}" for s in runs)
        print(
            f"{label:<32}{cells}  {median:9.3f}  {min(runs):8.3f}  {spread:6.1%}  {timed / median:8.2f}  "
            f"{1000 * median / timed:8.2f}  {median / bare:8.3f}  {min(runs) / best_bare:11.3f}  "
            f"{cpu[kind]:11.1f}  {cpu[kind] / cpu['bare']:8.3f}  {foreign:7.2f}"
        )
    print(
        "spread = (max - min) / median. CPU ms/step = CPU time of all processes of a side (every rank, "
        "all threads) per step, median of runs.\nforeign = the most CPU cores that other processes on this "
        "machine took during a timed window of that side."
    )
    print()
    print(
        f"Quiet windows only (log windows in which other processes took <= {args.quiet_threshold} cores), "
        "pooled over all runs of a side:"
    )
    quiet = {}
    for kind, label in sides:
        windows = [w for r in results[kind] for w in r["windows"]]
        calm = [w for w in windows if not math.isnan(w[2]) and w[2] <= args.quiet_threshold]
        quiet[kind] = 1000 * sum(w[1] for w in calm) / sum(w[0] for w in calm) if calm else math.nan
        fastest = min(1000 * w[1] / w[0] for w in windows)
        print(
            f"  {label:<32} {len(calm):3d}/{len(windows):<3d} windows quiet: {quiet[kind]:7.2f} ms/step "
            f"({quiet[kind] / quiet['bare'] if kind != 'bare' else 1.0:.3f} x bare); fastest window "
            f"{fastest:6.2f} ms/step"
        )
    if worst_foreign > 0.1 * os.cpu_count():
        print(
            f"WARNING: other processes took up to {worst_foreign:.2f} of {os.cpu_count()} cores during timed "
            "windows; the figures include their interference. Re-run on a quiet machine."
        )
    print()
    ratio = medians["trainer"] / bare
    verdict = "met" if ratio <= 1.03 else "NOT met"
    print(
        f"overhead_ratio = trainer / bare = {medians['trainer']:.3f} / {bare:.3f} = {ratio:.3f} "
        f"(target <= 1.03: {verdict})"
    )
    extra = ""
    if "trainer-ckpt" in medians:
        ckpt_ratio = medians["trainer-ckpt"] / bare
        print(f"with async checkpoints every {args.checkpoint_every} steps: {ckpt_ratio:.3f} x bare")
        extra = f" ckpt_overhead_ratio={ckpt_ratio:.4f} ckpt_trainer_seconds={medians['trainer-ckpt']:.3f}"
    if "trainer-paired" in medians:
        text, paired_extra = paired_summary(results["trainer-paired"], args.log_interval)
        print(text)
        extra += paired_extra
    for feature in ("metrics", "reporting"):  # what one feature adds to the trainer
        kind = f"trainer-{feature}"
        if kind not in medians:
            continue
        feature_ratio = medians[kind] / medians["trainer"]
        print(
            f"{feature}_overhead_ratio = trainer + {feature} / trainer = {feature_ratio:.3f} (target <= 1.01: "
            f"{'met' if feature_ratio <= 1.01 else 'NOT met'}); CPU ms/step {cpu[kind] / cpu['trainer']:.3f} x; "
            f"quiet windows {quiet[kind] / quiet['trainer']:.3f} x"
        )
        extra += f" {feature}_overhead_ratio={feature_ratio:.4f}"

    # The host's own cost per step: each round's trainer run against that round's bare run (the same minutes of the
    # machine), in ms a step; with the --host-cost model the step's compute is about a millisecond, so this is the
    # trainer's Python and synchronisation beyond the bare loop (issue 64: <= 0.2 ms).
    def paired_ms(side: str) -> float:
        return statistics.median(
            1000 * (t["seconds"] - b["seconds"]) / timed for t, b in zip(results[side], results["bare"])
        )

    host_ms = paired_ms("trainer")
    print(
        f"host_ms_per_step = trainer - bare per step, paired by round, median of {args.repeats} = {host_ms:.3f} ms "
        f"(bare {1000 * bare / timed:.3f} ms/step; issue 64's target <= 0.2 ms with --host-cost)"
    )
    extra += f" host_ms_per_step={host_ms:.4f}"
    if "trainer-baseline" in results:
        before_ms = paired_ms("trainer-baseline")
        print(
            f"host_ms_per_step of the --baseline checkout ({args.baseline}), paired the same way = {before_ms:.3f} ms; "
            f"this checkout {host_ms:.3f} ms: {before_ms - host_ms:+.3f} ms a step saved"
        )
        extra += f" baseline_host_ms_per_step={before_ms:.4f}"
    cpu_ratio = cpu["trainer"] / cpu["bare"]
    quiet_ratio = quiet["trainer"] / quiet["bare"]
    print(f"quiet-window ms/step, trainer / bare = {quiet_ratio:.3f} (timed only where the machine was otherwise idle)")
    print(f"CPU time per step, trainer / bare = {cpu_ratio:.3f} (less sensitive to other load on the machine)")
    # The trainer's own account (its log lines): model FLOP/s and MFU of the last window, start-up to the first step.
    own = {figure: statistics.median(r[figure] for r in results["trainer"]) for figure in ("tflops", "mfu", "startup")}
    mfu_text = "-" if math.isnan(own["mfu"]) else f"{own['mfu']:.1%}"
    print(
        f"trainer's own figures (medians): {own['tflops']:.4g} model TFLOP/s, MFU {mfu_text}, start-up to the first "
        f"step {own['startup']:.2f} s"
    )
    print(
        f"result: overhead_ratio={ratio:.4f} trainer_seconds={medians['trainer']:.3f} bare_seconds={bare:.3f}"
        f" quiet_overhead_ratio={quiet_ratio:.4f} cpu_overhead_ratio={cpu_ratio:.4f}{extra}"
        f" model_tflops={own['tflops']:.4g} mfu={own['mfu']:.4f} startup_s={own['startup']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
