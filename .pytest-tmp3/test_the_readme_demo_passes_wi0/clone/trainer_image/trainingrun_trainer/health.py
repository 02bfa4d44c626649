"""The non-finite policy: skip a bad step, roll back after N in a row, give up after M rollbacks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from trainingrun_api.config import HealthConfig


class Verdict(enum.Enum):
    OK = "ok"
    SKIP = "skip"  # drop this step's gradients, keep going
    ROLLBACK = "rollback"  # restore the last good checkpoint and lower the LR
    ABORT = "abort"  # permanent failure: the run diverges whatever we do


@dataclass
class NonFiniteGuard:
    config: HealthConfig
    consecutive: int = 0
    skipped_total: int = 0
    rollbacks: int = 0
    last_reason: str = field(default="")

    def observe(self, step: int, loss_finite: bool, grad_finite: bool) -> Verdict:
        if loss_finite and grad_finite:
            self.consecutive = 0
            return Verdict.OK
        self.consecutive += 1
        self.skipped_total += 1
        what = "loss" if not loss_finite else "gradient norm"
        self.last_reason = f"non-finite {what} at step {step}"
        if self.consecutive < self.config.max_consecutive_non_finite:
            return Verdict.SKIP
        self.consecutive = 0
        if self.rollbacks >= self.config.max_rollbacks:
            return Verdict.ABORT
        self.rollbacks += 1
        return Verdict.ROLLBACK

    def abort_message(self) -> str:
        cfg = self.config
        return (
            f"training diverged: {self.last_reason}; {cfg.max_consecutive_non_finite} non-finite steps in a row "
            f"after {self.rollbacks} rollback(s) (spec.trainer.health.maxRollbacks={cfg.max_rollbacks}). "
            "Lower spec.trainer.optimizer.lr, enable gradClipNorm, or use bf16-mixed instead of 16-mixed"
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_total = int(state.get("skipped_total", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
