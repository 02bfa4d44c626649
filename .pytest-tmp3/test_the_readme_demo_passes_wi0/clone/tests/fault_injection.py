"""A model and a dataset that inject faults into real trainer processes, for the fault tests.

The trainer subprocesses import this module by its `classPath` (`fault_injection.NaNCharTransformer`,
`fault_injection.FaultyText`) because the tests put tests/ on their PYTHONPATH, exactly as a user's
own model in a derived image is found: so these tests also show that a user's class_path works.

- `NaNCharTransformer`: the shipped CharTransformer whose loss becomes NaN on chosen training
  forward calls of this process (counted per process, not per step: after a rollback the model
  object survives and the step counter goes back, the call counter does not), on chosen ranks.
  The NaN is added to the loss as a constant, so the gradients stay finite: the loss is the only
  sign, as with a batch whose loss is 0/0 (every target ignored) on one rank.
- `FaultyText`: the shipped SyntheticText (same items for the same index) that can
  * record every training index it serves (one file per rank and process, `recordDir`), to check
    that a run resumed at another world size sees each sample exactly once, and
  * pause before serving its Nth training item (`pauseAtItems`, counted per process) until the test
    creates `<pauseDir>/release-<N>`. It logs `paused at item N` first, so a test can wait for that
    line and then act (break storage, send a signal, kill a worker) while the trainer stands at a
    known step: no sleeps, no races with the training loop. Item N of a run with batch size B and
    gradient accumulation A is the first item of step (N - 1) // (B * A) + 1.

Importing this module with FAULT_INJECTION_GCS_MOVE_IS_COPY=1 in the environment makes gcsfs's
move a copy + delete, for the GCS emulator only (see `_gcs_move_is_copy`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence

import torch
from torch import Tensor

from trainingrun_trainer.data import SyntheticText
from trainingrun_trainer.models import CharTransformer

__all__ = ["NaNCharTransformer", "FaultyText", "PAUSE_DEADLINE_S"]

log = logging.getLogger("fault_injection")

#: A paused trainer gives up after this long, so a broken test never leaves processes behind.
PAUSE_DEADLINE_S = 300.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _gcs_move_is_copy() -> None:
    """gcsfs moves an object with GCS's `moveTo` call; gcp-storage-emulator answers it with 501,
    which gcsfs retries for about 33 s before it falls back to copy + delete itself. DCP's writer
    commits `.metadata` by renaming `.metadata.tmp`, so every save to the emulator would pay that.
    Real GCS implements moveTo; this changes nothing but the emulator's missing endpoint (the same
    patch as the `gcs_move_is_copy` fixture in tests/storage_servers.py, for a subprocess)."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs
    from fsspec.asyn import AsyncFileSystem

    gcsfs.GCSFileSystem._mv_file = AsyncFileSystem._mv_file


if os.environ.get("FAULT_INJECTION_GCS_MOVE_IS_COPY") == "1":
    _gcs_move_is_copy()


class NaNCharTransformer(CharTransformer):
    """CharTransformer whose loss is NaN on the training forward calls `nanCalls` (1-based, per
    process) of the ranks `nanRanks` (default: every rank)."""

    def __init__(
        self,
        nan_calls: Sequence[int] = (),
        nan_ranks: Optional[Sequence[int]] = None,
        vocab_size: int = 128,
        dim: int = 16,
        layers: int = 1,
        heads: int = 2,
        context_length: int = 16,
    ):
        super().__init__(vocab_size=vocab_size, dim=dim, layers=layers, heads=heads, context_length=context_length)
        self.nan_calls = {int(c) for c in nan_calls}
        self.inject_here = nan_ranks is None or _rank() in {int(r) for r in nan_ranks}
        self.calls = 0

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        loss = super().forward(batch)
        if not self.training:
            return loss
        self.calls += 1
        if self.inject_here and self.calls in self.nan_calls:
            log.warning("injecting a NaN loss on forward call %d", self.calls)
            loss = loss + torch.tensor(float("nan"), device=loss.device)  # finite gradients
        return loss


class FaultyText(SyntheticText):
    """SyntheticText that records the training indices it serves and pauses at chosen items."""

    def __init__(
        self,
        num_samples: int = 4096,
        context_length: int = 16,
        vocab_size: int = 128,
        seed: int = 0,
        split: str = "train",
        record_dir: Optional[str] = None,
        pause_at_items: Sequence[int] = (),
        pause_dir: Optional[str] = None,
    ):
        super().__init__(
            num_samples=num_samples, context_length=context_length, vocab_size=vocab_size, seed=seed, split=split
        )
        if pause_at_items and not pause_dir:
            raise ValueError("pause_at_items needs pause_dir")
        self.record_dir = record_dir if split == "train" else None
        self.pause_at_items = {int(i) for i in pause_at_items} if split == "train" else set()
        self.pause_dir = pause_dir
        self.served = 0
        self._record = None

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if self.split == "train":
            self.served += 1
            if self.served in self.pause_at_items:
                self._pause(self.served)
            if self.record_dir:
                if self._record is None:
                    name = f"served-rank{_rank()}-pid{os.getpid()}.txt"
                    self._record = open(os.path.join(self.record_dir, name), "a", encoding="utf-8")
                self._record.write(f"{int(index)}\n")
                self._record.flush()
        return super().__getitem__(index)

    def _pause(self, item: int) -> None:
        release = os.path.join(self.pause_dir, f"release-{item}")
        log.warning("paused at item %d until %s exists", item, release)
        deadline = time.monotonic() + PAUSE_DEADLINE_S
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault_injection: {release} did not appear within {PAUSE_DEADLINE_S:.0f} s")
            time.sleep(0.01)  # polling a file the test creates, not a timing assumption
        log.warning("released at item %d", item)
