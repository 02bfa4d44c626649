"""A step's loss, gradient norm and non-finite flags: kept on the device by the step, read by the host a step late.

Reading a device value on the host (`float(loss)`, `.item()`) waits until the GPU has run everything queued before
it: while the host waits, nothing new is queued, so the GPU idles after that step until the host catches up. The
trainer did it twice a step (the loss after each micro-batch, the gradient norm before the optimizer step), 1.52x a
bare compiled loop's step on an H200. Now a step only queues work: its values stay on the device (`StepValues`), the
optimizer skips a non-finite step in its kernel (`optim.step_unless`), and `LateValues` copies each step's few numbers
into pinned host memory without waiting, an event behind them; the host reads them once the event says the copy is
done, usually at the next step, when the GPU has long finished it. The host's decisions that need them (the
non-finite policy's skip, rollback and abort, the logs and metrics) come one step late; before a checkpoint, an
evaluation and at the end the trainer waits for them all (`drain`), so what a checkpoint holds is what a run that
waited every step would hold.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

#: Steps whose values may be in flight before the host waits for the oldest: the GPU may run this far behind.
MAX_IN_FLIGHT = 4


@dataclass(frozen=True)
class StepValues:
    """What the host learns about step `step`, all of it a step or so late."""

    step: int
    learning_rate: float  #: the rate the step ran with (a host value, carried along)
    loss: float  #: summed over the step's micro-batches (each divided by their number), as the model's loss
    grad_norm: float  #: the total norm before clipping, over every rank's gradients
    loss_finite: bool  #: on every rank
    grad_finite: bool


def step_tensor(loss: torch.Tensor, grad_norm: torch.Tensor, agree: bool = True) -> torch.Tensor:
    """[loss, grad norm, loss not finite, grad norm not finite] as float32 on the loss's device, the flags agreed by
    every rank (the largest: a non-finite loss on one rank skips the step on all of them, or the replicas drift). One
    tiny all_reduce when distributed: queued behind the step on a GPU (NCCL), done on the host for gloo; neither waits
    for a device. `agree=False`: the caller agrees them (CPU training: the loss in `Run.agree_async` itself, the norm being global).
    Few operations, as each costs the host a few microseconds to queue."""
    values = torch.stack([loss.float(), grad_norm.to(loss.device, torch.float32)])
    flags = values.isfinite().logical_not_().float()
    if agree and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return torch.cat([values, flags])


def found_inf(step: torch.Tensor) -> torch.Tensor:
    """A `step_tensor`'s verdict as the fused optimizers take it: 1.0 when either value was not finite anywhere."""
    return step[2:].amax()


class LateValues:
    """`put` each step's device tensors; `ready` hands back, in step order, the values of the steps whose copy to
    the host is done; `drain` waits for all of them."""

    def __init__(self, device: torch.device):
        self._on_gpu = device.type == "cuda"
        self._pending: collections.deque[tuple[int, float, torch.Tensor, Optional[torch.cuda.Event]]] = (
            collections.deque()
        )

    def put(self, step: int, learning_rate: float, values: torch.Tensor) -> None:
        """Step `step`'s `step_tensor` (and the rate it ran with, a host value carried along)."""
        if not self._on_gpu:  # a CPU's tensors are ready as soon as they exist
            self._pending.append((step, learning_rate, values, None))
            return
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._pending.append((step, learning_rate, host, copied))

    def ready(self) -> list[StepValues]:
        """The steps whose values reached the host; waits only for the oldest when `MAX_IN_FLIGHT` are pending (the
        GPU that far behind, the host queues nothing new until it catches up: the copy costs it nothing)."""
        return self._take(wait_for_all=False)

    def drain(self) -> list[StepValues]:
        """Every pending step's values, waiting for their copies: at checkpoints, evaluations and the end."""
        return self._take(wait_for_all=True)

    def _take(self, wait_for_all: bool) -> list[StepValues]:
        done = []
        while self._pending:
            copied = self._pending[0][-1]
            if copied is not None and not copied.query():
                if not wait_for_all and len(self._pending) < MAX_IN_FLIGHT:
                    break
                copied.synchronize()
            done.append(_values(*self._pending.popleft()))
        return done

    def clear(self) -> None:
        """Forget the pending steps (a rollback discards them)."""
        self._pending.clear()


def _values(step: int, learning_rate: float, host: torch.Tensor, _: object) -> StepValues:
    # numpy() reads host memory only (a CUDA tensor refuses it): never a wait for the device.
    loss, grad_norm, loss_bad, grad_bad = host.numpy().tolist()
    return StepValues(step, learning_rate, loss, grad_norm, not loss_bad, not grad_bad)
