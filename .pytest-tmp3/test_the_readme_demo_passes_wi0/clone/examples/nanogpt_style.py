"""A training script in the shape of Karpathy's nanoGPT `train.py` (a uint16 token file read at random offsets,
AdamW with decay and no-decay groups, a cosine schedule with warm-up, gradient accumulation and clipping, DDP under
torchrun), written here from that shape, with the lines a user adds or changes for the platform marked
`# trainingrun`. They give it checkpoints in object storage, exact resume after a crash or a lost pod (node memory first),
preemption handling, progress in `kubectl get tr` and `trainingrun local`'s chaos options.

What the original does instead: its own `torch.save(checkpoint, 'ckpt.pt')` on rank 0 every `eval_interval`, and
`init_from = 'resume'` set by hand, which loads the model and optimizer but not the data position or the RNG.

    # a TrainingRun with spec.command: [python, -m, trainingrun_trainer.launch, nanogpt_style.py]
    NANOGPT_DATA=train.bin trainingrun local run.yaml --chaos-kill-step 30
"""

import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainingrun_trainer  # trainingrun
from trainingrun_trainer.seeding import rng_state, set_rng_state  # trainingrun

DATA = os.environ.get("NANOGPT_DATA", "train.bin")
MAX_ITERS = int(os.environ.get("NANOGPT_MAX_ITERS", "60"))
BLOCK_SIZE, BATCH_SIZE, ACCUMULATION, VOCAB = 32, 8, 2, 256
LEARNING_RATE, MIN_LR, WARMUP_ITERS, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 1e-4, 10, 0.1, 1.0


class GPT(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 64, heads: int = 4):
        super().__init__()
        self.token = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(BLOCK_SIZE, dim)
        layer = lambda: nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)  # noqa: E731
        self.blocks = nn.ModuleList(layer() for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.token(idx) + self.position(torch.arange(idx.size(1)))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def get_batch(generator):
    data = np.memmap(DATA, dtype=np.uint16, mode="r")
    offsets = torch.randint(len(data) - BLOCK_SIZE - 1, (BATCH_SIZE,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK_SIZE].astype(np.int64)) for i in offsets])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK_SIZE].astype(np.int64)) for i in offsets])
    return x, y


def get_lr(it):
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    ratio = (it - WARMUP_ITERS) / max(1, MAX_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def main() -> int:
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        trainingrun_trainer.init_process_group("gloo")  # trainingrun: (dist.init_process_group) in-place restarts
    rank = dist.get_rank() if ddp else 0
    torch.manual_seed(1337)
    generator = torch.Generator().manual_seed(1337 + rank)
    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.95),
    )
    raw_model = model
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)

    run = trainingrun_trainer.Run.from_env()  # trainingrun
    state = {"model": raw_model, "optim": optimizer}  # trainingrun
    resumed = run.resume(state)  # trainingrun: everything or a one-line error, never half
    iter_num = resumed["iter_num"] if resumed else 0  # trainingrun
    if resumed:  # trainingrun: the data order and RNG too, so the run continues exactly
        generator.set_state(resumed["generator"]), set_rng_state(resumed["rng"])

    stop = False
    while iter_num < MAX_ITERS:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        for micro_step in range(ACCUMULATION):
            x, y = get_batch(generator)
            if ddp:
                model.require_backward_grad_sync = micro_step == ACCUMULATION - 1
            _, loss = model(x, y)
            (loss / ACCUMULATION).backward()
        nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        run.wait_for_commit()  # trainingrun: a save's copy is done before the weights change
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        run.report(iter_num, total_steps=MAX_ITERS, loss=loss.item())  # trainingrun: progress, and local's chaos
        stop, save = run.checkpoint_due(iter_num)  # trainingrun
        if stop or save or iter_num == MAX_ITERS:  # trainingrun
            extra = {"iter_num": iter_num, "generator": generator.get_state(), "rng": rng_state()}  # trainingrun
            last = iter_num == MAX_ITERS  # the final model's digest, which `trainingrun checkpoints` lists
            digest = trainingrun_trainer.model_digest(raw_model.state_dict()) if last else ""
            run.save(iter_num, state, extra, model_digest=digest, blocking=stop or last)  # trainingrun
        if stop:
            break
    run.close()  # trainingrun
    if rank == 0:
        print(f"done: iter {iter_num} loss {loss.item():.4f}")
    if ddp:
        dist.destroy_process_group()
    return run.PREEMPTED_EXIT_CODE if stop else 0  # trainingrun


if __name__ == "__main__":
    sys.exit(main())
