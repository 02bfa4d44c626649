"""Host-device synchronising calls per training step: the trainer vs a bare loop (issue 64's gate, measured on CPU).

What is counted
    Calls that make the host wait for the device on a GPU (tests/sync_counting.py: `Tensor.item`, `__float__`,
    `tolist`, `cpu`, `Event.synchronize`...; on a CPU they wait for nothing, which is why they are counted), during
    steps between log intervals: a step whose number is a multiple of `--log-interval` is left out with the step
    after it, and so are the first steps (`--warmup-steps`) and the final save. Calls torch makes itself count too
    (on a CPU, AdamW reads each parameter's step counter with `.item()`), on both sides alike, so the figure to read
    is the difference: what the trainer adds per step.

How
    One process, no torchrun: the trainer (`Trainer(config, context, "cpu").run()`, the tiny CharTransformer of the
    tests, a checkpoint interval past the last step) and a bare loop of the same model, AdamW, clipping and schedule.
    Calls are attributed to the step the trainer (or the loop) is at when they are made.

Target (issue 64): the trainer adds 0 per step between log intervals.

Run by hand, never by the test suite:
    .venv/bin/python benchmarks/step_syncs.py            # about 20 s on the 2-core VM
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sync_counting import SyncCounter  # noqa: E402 - the tests' helpers, beside this file's repository


def trainer_config(args: argparse.Namespace, root: Path) -> dict:
    from tiny_runs import tiny_trainer

    trainer = tiny_trainer(samples=4096, maxSteps=args.steps, logIntervalSteps=args.log_interval, seed=1)
    return {"trainer": trainer, "checkpoint": {"uri": f"file://{root}/ckpt", "interval": {"steps": args.steps * 10}}}


def count_trainer(args: argparse.Namespace) -> SyncCounter:
    import yaml

    from trainingrun_trainer.context import RunContext
    from trainingrun_trainer.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="step-syncs-"))
    (root / "config.yaml").write_text(yaml.safe_dump(trainer_config(args, root)))
    os.environ.update({"TRAININGRUN_CONFIG": str(root / "config.yaml"), "TRAININGRUN_NAME": "syncs"})
    context = RunContext.from_env()
    trainer = Trainer(context.load_config(), context, "cpu")
    with SyncCounter(lambda: trainer.progress.step) as counter:
        trainer.run()
    return counter


def count_bare(args: argparse.Namespace) -> SyncCounter:
    from trainingrun_trainer.data import SyntheticText
    from trainingrun_trainer.models import CharTransformer

    torch.manual_seed(1)
    model = CharTransformer(dim=16, layers=1, heads=2, context_length=16)
    data = torch.utils.data.DataLoader(SyntheticText(num_samples=4096, context_length=16), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)  # the trainer's default
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    step = 0
    with SyncCounter(lambda: step) as counter:
        for batch in data:
            if step == args.steps:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = model(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            if step % args.log_interval == 0:
                print(f"step {step} loss {float(loss.detach()):.4f}", file=sys.stderr)
    return counter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--log-interval", type=int, default=20, help="steps between log lines (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps left out (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    trainer, bare = count_trainer(args), count_bare(args)
    window = (args.warmup_steps, args.steps - 1, args.log_interval)
    ours, theirs = trainer.per_step(*window), bare.per_step(*window)
    print(f"sync calls per step between log intervals: trainer {ours:.1f}, bare loop {theirs:.1f}")
    print(f"  trainer's by call (whole run): {dict(trainer.by_call)}")
    print(f"  bare loop's by call (whole run): {dict(bare.by_call)}")
    added = ours - theirs
    print(f"RESULT trainer_added_syncs_per_step={added:.1f} target=0 {'ok' if added <= 0 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
