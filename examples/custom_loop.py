"""A training script with its own loop that still gets the platform's checkpoints, resume,
preemption handling and status reporting, through `trainingrun_trainer.Run`.

Run it in a TrainingRun by setting `spec.command: [python, -m, trainingrun_trainer.launch, custom_loop.py]`
in your own image; `trainingrun local FILE` runs that same command here (with `--chaos-kill-step`, which acts
in `run.report`). Or by hand:

    TRAININGRUN_CONFIG=run.yaml torchrun --standalone --nproc-per-node 2 examples/custom_loop.py

where run.yaml has at least `checkpoint: {uri: file:///tmp/ckpt}` (the `trainer` section is
yours to ignore: this script reads its own settings from the environment).
"""

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import trainingrun_trainer
from trainingrun_trainer.seeding import rng_state, seed_everything, set_rng_state

TOTAL_STEPS = int(os.environ.get("CUSTOM_LOOP_STEPS", "50"))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        trainingrun_trainer.init_process_group("gloo")  # safe across torchrun's in-place restarts
    rank = dist.get_rank() if dist.is_initialized() else 0
    seed_everything(0, rank)

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    run = trainingrun_trainer.Run.from_env()
    # The model and optimizer themselves: Run converts them (the optimizer's state in full, even before its first
    # step) and loads them back; a resume that would leave anything of the checkpoint unread raises, never half loads.
    extra = run.resume({"model": model, "optim": optimizer})  # None on a fresh start
    step = 0
    if extra is not None:
        step = extra["step"]
        set_rng_state(extra["rng"])

    loss = torch.tensor(float("nan"))
    while step < TOTAL_STEPS:
        began = time.perf_counter()
        x = torch.randn(64, 8)
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        own_seconds = time.perf_counter() - began  # data and forward: no collective inside, so a straggler's is longer
        optimizer.zero_grad()
        loss.backward()
        run.wait_for_commit()  # after a save: a lost pod then costs at most one checkpoint interval
        optimizer.step()
        step += 1
        run.report(step, total_steps=TOTAL_STEPS, loss=loss.item())

        stop, save = run.checkpoint_due(step, own_seconds=own_seconds)  # agreed by every rank; compares their times
        if stop or (save and step < TOTAL_STEPS):  # the last step is saved below, once
            run.save(step, {"model": model, "optim": optimizer}, {"step": step, "rng": rng_state()}, blocking=stop)
        if stop:
            run.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            return run.PREEMPTED_EXIT_CODE

    run.save(
        step,
        {"model": model, "optim": optimizer},
        {"step": step, "rng": rng_state()},
        model_digest=trainingrun_trainer.model_digest(model.state_dict()),
        blocking=True,
    )
    run.close()
    if rank == 0:
        print(f"done: step {step} loss {loss.item():.4f}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
