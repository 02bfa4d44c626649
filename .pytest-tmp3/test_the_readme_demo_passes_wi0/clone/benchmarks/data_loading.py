"""Data loading: the built-in trainer reading token shards from the GCS emulator vs local files vs synthetic data.

What is measured
    The same training (`trainingrun_trainer.models.CharTransformer`, default dim 128, 2 layers, 4 heads,
    context 64; batch 32; one process under torchrun, gloo on CPU or NCCL with `--device cuda`) fed four ways:

    * synthetic: `trainingrun_trainer.data.SyntheticText` (made in memory: the floor of data cost);
    * local shards: `trainingrun_trainer.shards.TokenShards` on file:// (two nanoGPT uint16 shards of the synthetic
      text's tokens, `--shard-tokens` each);
    * GCS shards, cold: the same shards on gcp-storage-emulator (gs://, on 127.0.0.1, behind a proxy that adds
      `--storage-latency-ms` to each request, default 30, as a cloud bucket's), the block cache empty. The emulator
      listens with a backlog of 128 (storage_servers.gcs_emulator_command): with socketserver's 5, concurrent
      fetches beyond 5 waited for the kernel's 1 s SYN retry, which no cloud bucket makes them do;
    * GCS shards, cold, no read-ahead: the same with `readAhead: 0` (every block fetched when an item needs it);
    * GCS shards, warm: again, with the cache the cold run filled (a later epoch, or another rank of the node).

    Per side: steps/s and the data-wait fraction, from the trainer's own Prometheus series, written to a
    PROMETHEUS_MULTIPROC_DIR as under the launcher: `trainingrun_data_wait_seconds` (time a step waited for its
    batches) over `trainingrun_step_duration_seconds` (whole steps), summed over every step, the first included
    (the DataLoader starts its workers then, and that is part of reading). steps/s = steps / summed step seconds
    (process start, model build and the final checkpoint are outside steps). DataLoader workers: `--workers`
    (default: the trainer's default, 0: batches are then read on the training thread) and
    `--prefetch`.

Target
    data_wait_fraction (GCS shards, cold) <= 0.02 with the default workers.

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/data_loading.py                    # CPU, about 2 minutes
    .venv/bin/python benchmarks/data_loading.py --repeat 5         # medians and ranges, about 12 minutes
    .venv/bin/python benchmarks/data_loading.py --workers 2
    .venv/bin/python benchmarks/data_loading.py --device cuda --dim 512 --layers 6 --heads 8
The last line is `result: data_wait_fraction=<x> shards_steps_per_s=<x> synthetic_steps_per_s=<x>
local_steps_per_s=<x> warm_steps_per_s=<x> no_read_ahead_data_wait_fraction=<x>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from storage_servers import _free_port, _start, _stop, gcs_emulator_command  # noqa: E402 - sets gcsfs's env before its import


def shard_bytes(tokens_per_shard: int) -> list[bytes]:
    from trainingrun_trainer.data import SyntheticText

    text = SyntheticText(num_samples=2 * tokens_per_shard // 64 + 1, context_length=63, vocab_size=128, seed=3)
    tokens = np.concatenate([text[i]["tokens"].numpy() for i in range(len(text))]).astype("<u2")
    return [tokens[:tokens_per_shard].tobytes(), tokens[tokens_per_shard : 2 * tokens_per_shard].tobytes()]


class SlowProxy:
    """A TCP proxy in a thread of its own that holds every chunk the client sends for `delay` seconds before
    forwarding it: each storage request pays that latency, as requests to a cloud bucket do (tens of ms), which
    the emulator on loopback does not."""

    def __init__(self, target_port: int, delay: float):
        import asyncio
        import threading

        self.port, self.delay, self.target_port = _free_port(), delay, target_port
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait(10)

    def _serve(self, started) -> None:
        import asyncio

        async def pipe(reader, writer, delay: float) -> None:
            try:
                while data := await reader.read(65536):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        async def handle(client_reader, client_writer) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(pipe(client_reader, server_writer, self.delay), pipe(server_reader, client_writer, 0))

        async def main() -> None:
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            started.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())


def run_trainer(work: Path, name: str, dataset: dict, args: argparse.Namespace, env: dict, **trainer: object) -> dict:
    """Train `args.steps` steps on `dataset` (one process under torchrun, more `trainer` fields as given); steps/s
    and the data-wait fraction from the trainer's own Prometheus series."""
    metrics = work / f"metrics-{name}"
    metrics.mkdir()
    model = {
        "classPath": "trainingrun_trainer.models.CharTransformer",
        "initArgs": {
            "vocabSize": 128,
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "contextLength": args.context,
        },
    }
    data = {"dataset": dataset, "batchSize": args.batch_size}
    if args.workers is not None:
        data["numWorkers"] = args.workers
    if args.prefetch is not None:
        data["prefetchFactor"] = args.prefetch
    config = {
        "trainer": {"model": model, "data": data, "maxSteps": args.steps, "logIntervalSteps": 50, **trainer},
        "checkpoint": {"uri": f"file://{work}/ckpt-{name}", "interval": {"steps": 10**6}},
    }
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("TRAININGRUN_", "PET_"))}
    environment.update(
        {
            "TRAININGRUN_CONFIG": str(work / f"{name}.yaml"),
            "TRAININGRUN_NAME": name,
            "PROMETHEUS_MULTIPROC_DIR": str(metrics),
            "OMP_NUM_THREADS": str(args.threads),
            **env,
        }
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "trainingrun_trainer",
    ]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the trainer exited {done.returncode}:\n{done.stderr[-3000:]}")
    (work / f"{name}.log").write_text(done.stderr)
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(metrics))
    sums = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in (
                "trainingrun_data_wait_seconds_sum",
                "trainingrun_step_duration_seconds_sum",
                "trainingrun_step_duration_seconds_count",
            ):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    step_seconds = sums["trainingrun_step_duration_seconds_sum"]
    return {
        "steps_per_s": sums["trainingrun_step_duration_seconds_count"] / step_seconds,
        "data_wait_fraction": sums["trainingrun_data_wait_seconds_sum"] / step_seconds,
    }


def training_arguments(description: str) -> argparse.ArgumentParser:
    """The training every side of this benchmark (and tracker_overhead.py) runs: model, batch, steps, threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None, help="numWorkers (default: the trainer's)")
    parser.add_argument("--prefetch", type=int, default=None, help="prefetchFactor (needs --workers > 0)")
    return parser


def main() -> None:
    parser = training_arguments(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=20_000_000,
        help="tokens per shard (two shards; default 20 M: 80 blocks of 1 MiB to fetch)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--storage-latency-ms",
        type=float,
        default=30.0,
        help="latency added to each request to the GCS emulator, as a cloud bucket has (default 30)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of all sides; each figure is then the median, with the range beside it "
        "(on this 2-core VM one data-wait figure moves by about 0.5 percentage points)",
    )
    args = parser.parse_args()
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}

    work = Path(tempfile.mkdtemp(prefix="data-loading-"))
    local = work / "shards"
    local.mkdir()
    shards = shard_bytes(args.shard_tokens)
    for n, content in enumerate(shards):
        (local / f"train_{n:03d}.bin").write_bytes(content)
    port = _free_port()
    emulator, log = _start(gcs_emulator_command(port), port, "gcp-storage-emulator")
    try:
        import gcsfs

        endpoint = f"http://127.0.0.1:{port}"
        fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", project="bench")
        fs.mkdir("bench")
        for n, content in enumerate(shards):
            fs.pipe_file(f"bench/tokens/train_{n:03d}.bin", content)
        slow = SlowProxy(port, args.storage_latency_ms / 1000)
        gcs_env = {**env, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{slow.port}", "NO_GCE_CHECK": "true"}

        def tokens(uri: str, **more: int) -> dict:
            return {
                "classPath": "trainingrun_trainer.shards.TokenShards",
                "initArgs": {"uri": uri, "contextLength": args.context, "vocabSize": 128, **more},
            }

        synthetic = {
            "classPath": "trainingrun_trainer.data.SyntheticText",
            "initArgs": {"numSamples": 100_000, "contextLength": args.context, "vocabSize": 128},
        }
        rounds = []
        for round_ in range(args.repeat):
            cache = {"TRAININGRUN_DATA_CACHE": str(work / f"cache-local-{round_}")}
            gcs_cache, gcs_cache_2 = str(work / f"cache-gcs-{round_}"), str(work / f"cache-gcs-2-{round_}")
            rounds.append(
                [
                    ("synthetic", run_trainer(work, f"synthetic-{round_}", synthetic, args, env)),
                    (
                        "local shards",
                        run_trainer(work, f"local-{round_}", tokens(f"file://{local}"), args, {**env, **cache}),
                    ),
                    (
                        "GCS shards, cold",
                        run_trainer(
                            work,
                            f"cold-{round_}",
                            tokens("gs://bench/tokens"),
                            args,
                            {**gcs_env, "TRAININGRUN_DATA_CACHE": gcs_cache},
                        ),
                    ),
                    (
                        "GCS shards, warm",
                        run_trainer(
                            work,
                            f"warm-{round_}",
                            tokens("gs://bench/tokens"),
                            args,
                            {**gcs_env, "TRAININGRUN_DATA_CACHE": gcs_cache},
                        ),
                    ),
                    (
                        "GCS, cold, no read-ahead",
                        run_trainer(
                            work,
                            f"cold-no-read-ahead-{round_}",
                            tokens("gs://bench/tokens", readAhead=0),
                            args,
                            {**gcs_env, "TRAININGRUN_DATA_CACHE": gcs_cache_2},
                        ),
                    ),
                ]
            )
    finally:
        _stop(emulator)
        log.close()
    sides = [
        (name, {key: statistics.median(r[n][1][key] for r in rounds) for key in figures})
        for n, (name, figures) in enumerate(rounds[0])
    ]
    base = sides[0][1]["steps_per_s"]
    print(
        f"{args.steps} steps, batch {args.batch_size}, context {args.context}, workers "
        f"{'default (0)' if args.workers is None else args.workers}, device {args.device}; GCS requests "
        f"+{args.storage_latency_ms:g} ms; shards of {args.shard_tokens} tokens"
        + (f"; medians of {args.repeat} rounds, data wait range beside" if args.repeat > 1 else "")
    )
    print(f"{'data':<26}{'steps/s':>10}{'vs synthetic':>14}{'data wait':>12}")
    for n, (name, figures) in enumerate(sides):
        waits = [r[n][1]["data_wait_fraction"] for r in rounds]
        spread = f"  ({min(waits):.1%}-{max(waits):.1%})" if args.repeat > 1 else ""
        print(
            f"{name:<26}{figures['steps_per_s']:>10.1f}{figures['steps_per_s'] / base:>14.2f}"
            f"{figures['data_wait_fraction']:>11.1%}{spread}"
        )
    cold, local_side, warm = sides[2][1], sides[1][1], sides[3][1]
    print(
        f"result: data_wait_fraction={cold['data_wait_fraction']:.4f} shards_steps_per_s={cold['steps_per_s']:.2f} "
        f"synthetic_steps_per_s={base:.2f} local_steps_per_s={local_side['steps_per_s']:.2f} "
        f"warm_steps_per_s={warm['steps_per_s']:.2f} "
        f"no_read_ahead_data_wait_fraction={sides[4][1]['data_wait_fraction']:.4f}"
    )


if __name__ == "__main__":
    main()
