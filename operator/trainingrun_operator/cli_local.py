"""The `trainingrun` commands that run on this machine with trainer code (cli.py has the parser): `local`,
`checkpoints` and `data prepare`. The trainer is imported by name when one of them runs, so the operator image,
which has no torch, still starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from . import validation


def trainer_module(name: str, command: str) -> Any:
    """A module of the trainer package, imported when a command runs: the operator image has no torch."""
    import importlib

    try:
        return importlib.import_module(f"trainingrun_trainer.{name}")
    except ImportError as error:
        print(
            f"trainingrun {command} needs the trainer extra (pip install 'trainingrun-operator[trainer]'): {error}",
            file=sys.stderr,
        )
        return None


def cmd_checkpoints(args: argparse.Namespace) -> int:
    checkpoint = trainer_module("checkpoint", "checkpoints")
    if checkpoint is None:
        return 1
    try:
        store = checkpoint.CheckpointStore(args.uri, endpoint_url=args.endpoint_url)
        infos = store.list()
    except (OSError, ValueError) as error:
        print(f"cannot list checkpoints under {args.uri}: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(checkpoint.to_json(infos))
    elif infos:
        print(checkpoint.format_table(infos))
    else:
        print(f"no checkpoints under {args.uri}")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    prepare = trainer_module("prepare", "data prepare")
    if prepare is None:
        return 1
    bar = ByteProgress(sys.stderr)
    try:
        done = prepare.prepare(
            Path(args.src),
            args.dest,
            args.kind,
            shard_bytes=args.shard_mb,
            overwrite=args.overwrite,
            endpoint_url=args.endpoint_url,
            progress=bar.update,
        )
    except prepare.PrepareError as error:
        bar.close()
        print(f"trainingrun data prepare: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        bar.close()
        print(f"trainingrun data prepare: cannot write {args.dest}: {error}", file=sys.stderr)
        return 1
    bar.close()
    use = (
        "trainingrun_trainer.shards.TextBytes, initArgs {uri: %s} (model vocabSize 256)"
        if args.kind == "text"
        else "trainingrun_trainer.shards.ImageShards, initArgs {uri: %s, imageSize: 32}"
    ) % args.dest
    if done.skipped_links:
        print(
            f"trainingrun data prepare: skipped {done.skipped_links} link(s) below {args.src} to files outside it",
            file=sys.stderr,
        )
    print(
        f"{done.files} files, {done.bytes} bytes -> {len(done.shards)} shards under {args.dest}; train on them with "
        f"classPath {use}"
    )
    return 0


def progress_bars(out: Any) -> bool:
    """Whether to draw progress bars on `out`: a terminal, with rich installed (the `cli` extra); else plain lines."""
    import importlib.util

    return out.isatty() and importlib.util.find_spec("rich") is not None


class ByteProgress:
    """A bar of bytes on terminals, a line per tenth elsewhere."""

    def __init__(self, out: Any):
        self.out, self.bar, self.said = out, None, -1
        self.task: Any = None  #: rich's TaskID, once the total is known
        if progress_bars(out):
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self.bar = Progress(
                BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=out)
            )
            self.bar.start()

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("prepare", total=total)
            self.bar.update(self.task, completed=done)
        elif total and done * 10 // total > self.said:
            self.said = done * 10 // total
            print(f"{done}/{total} bytes ({100 * done // total}%)", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def cmd_local(args: argparse.Namespace) -> int:
    from . import local

    options = local.LocalOptions(
        nproc=args.nproc,
        nodes=args.nodes,
        checkpoint_uri=args.checkpoint_uri,
        max_steps=args.max_steps,
        chaos_kill_steps=args.chaos_kill_step or [],
        chaos_kill_every=args.chaos_kill_every,
        chaos_lose_node_step=args.chaos_lose_node,
        chaos_hang=args.chaos_hang,
        chaos_slow_rank=args.chaos_slow_rank,
        metrics_port=args.metrics_port,
        env_file=args.env_file,
        runs_dir=args.runs_dir,
    )
    try:
        run = local.load_run(args.file, options)
        local.check_options(run, options)
        secrets = local.resolve_secrets(run.spec, dict(os.environ), options.env_file)
    except validation.InvalidTrainingRun as error:
        error.print_to_stderr(args.file)
        return 1
    except local.LocalOptionError as error:
        print(f"trainingrun local: {error}", file=sys.stderr)
        return 2
    except local.LocalRunError as error:
        print(f"{args.file}: {error}", file=sys.stderr)
        return 1
    display = local.RichDisplay(sys.stdout) if progress_bars(sys.stdout) else local.PlainDisplay(sys.stdout)
    metrics = f"; metrics on http://127.0.0.1:{options.metrics_port}/metrics" if options.metrics_port else ""
    nproc = options.nproc or run.spec.nproc_per_node
    where = f"{options.nodes} simulated nodes of {nproc}" if options.nodes > 1 else f"{nproc}"
    print(
        f"running {run.metadata.name}: {run.spec.trainer.max_steps} steps on {where} process(es), checkpoints in "
        f"{run.spec.checkpoint.uri}{metrics}",
        flush=True,
    )
    own = local.own_command(run.spec)
    if own is not None:
        print(
            f"your command (spec.command and spec.args), as a pod runs it: {' '.join(own)} (here `python` is this "
            "Python and `torchrun` its torch.distributed.run; torchrun's settings come as PET_* variables)",
            flush=True,
        )
    runner = local.LocalRunner(run, options, secrets, out=sys.stdout, display=display)
    try:
        summary = runner.execute()
    finally:
        display.close()
    for note in summary.chaos_notes:
        print(note)
    if summary.message:
        print(summary.message, file=sys.stderr if summary.outcome != "succeeded" else sys.stdout)
    in_place = f" and {summary.restarts_in_place} restart(s) in place" if summary.restarts_in_place else ""
    print(f"{summary.outcome} after {summary.attempts} attempt(s){in_place}; logs in {runner.run_dir}")
    print(summary.breakdown_line())
    for line in (
        summary.startup_line(),
        summary.interval_line(),
        summary.throughput_line(),
        summary.eval_line(),
        *summary.hang_lines(),
        *summary.slow_rank_lines(),
    ):
        if line:
            print(line)
    print(summary.result_line(), flush=True)
    return summary.exit_code
