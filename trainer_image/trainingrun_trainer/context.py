"""The operator-trainer contract: what a trainer process learns from its environment.

The operator (and `trainingrun local`) set these variables; torchrun adds RANK, WORLD_SIZE,
LOCAL_RANK and friends. Reading them in one place keeps the contract in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from trainingrun_api import contract

if TYPE_CHECKING:
    from trainingrun_api.config import RunConfig


class ContextError(ValueError):
    """A contract variable is missing or malformed; a permanent error."""


def chaos_step(steps: str, restart_count: int) -> Optional[int]:
    try:
        planned = [int(step) for step in steps.split(",") if step.strip()]
    except ValueError:
        raise ContextError(f"TRAININGRUN_CHAOS_KILL_AT_STEP={steps!r} is not a comma-separated list of steps") from None
    return planned[restart_count] if restart_count < len(planned) else None


def hang_timeout(raw: str) -> Optional[float]:
    """TRAININGRUN_HANG_TIMEOUT_SECONDS: None for `auto` (or unset), else seconds (0: off)."""
    if raw.strip() in ("", "auto"):
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 7 * 86400:
        raise ContextError(
            f"{contract.HANG_TIMEOUT_SECONDS}={raw!r} is neither 'auto' nor seconds from 0 to a week "
            "(spec.recovery.hangTimeoutSeconds)"
        )
    return seconds


CHAOS_HANG_KINDS = contract.CHAOS_HANG_KINDS
DEFAULT_SLOW_RANK_FACTOR = contract.DEFAULT_SLOW_RANK_FACTOR


def slow_rank_factor(raw: str) -> float:
    """TRAININGRUN_SLOW_RANK_FACTOR: the factor (unset: the default; 0: off)."""
    if not raw.strip():
        return DEFAULT_SLOW_RANK_FACTOR
    try:
        factor = float(raw)
    except ValueError:
        factor = -1.0
    low, high = contract.SLOW_RANK_FACTORS
    if not (factor == 0 or low <= factor <= high):
        raise ContextError(
            f"{contract.SLOW_RANK_FACTOR}={raw!r} is neither 0 (off) nor a factor from {low} to {high:g} "
            "(spec.recovery.slowRankFactor)"
        )
    return factor


def chaos_slow_rank(raw: str, world_size: int) -> tuple[float, int]:
    """TRAININGRUN_CHAOS_SLOW_RANK FACTOR[:RANK] (`trainingrun local --chaos-slow-rank`): (factor, rank), the last
    rank by default."""
    try:
        return contract.chaos_slow_rank(raw, world_size)
    except ValueError as error:
        raise ContextError(f"{contract.CHAOS_SLOW_RANK}={raw!r}: {error}") from None


@dataclass(frozen=True)
class ChaosHang:
    """`trainingrun local --chaos-hang KIND:STEP[:RANK]`: after `step`, `rank` hangs as `kind` says."""

    kind: str
    step: int
    rank: Optional[int] = None  #: None: the last rank

    @classmethod
    def parse(cls, raw: str) -> "ChaosHang":
        parts = raw.split(":")
        try:
            kind, step, rank = parts[0], int(parts[1]), (int(parts[2]) if len(parts) > 2 else None)
        except (IndexError, ValueError):
            kind, step, rank = "", -1, None
        if kind not in CHAOS_HANG_KINDS or step < 1 or len(parts) > 3 or (rank is not None and rank < 0):
            raise ContextError(
                f"{contract.CHAOS_HANG}={raw!r} is not KIND:STEP[:RANK] with KIND one of {', '.join(CHAOS_HANG_KINDS)}"
            )
        return cls(kind, step, rank)

    def fires(self, step: int, rank: int, world_size: int) -> bool:
        return step == self.step and rank == (self.rank if self.rank is not None else world_size - 1)


@dataclass(frozen=True)
class RunContext:
    name: str  #: TRAININGRUN_NAME
    namespace: str  #: TRAININGRUN_NAMESPACE
    uid: str  #: TRAININGRUN_UID
    attempt: int  #: TRAININGRUN_ATTEMPT, from 1
    config_path: str  #: TRAININGRUN_CONFIG: the mounted RunConfig YAML
    resume_from: Optional[str]  #: TRAININGRUN_RESUME_FROM: the operator's last reported checkpoint, a floor
    metrics_port: Optional[int]  #: TRAININGRUN_METRICS_PORT
    pod_name: str  #: TRAININGRUN_POD_NAME (downward API), or the host name
    rank: int  #: RANK (torchrun)
    local_rank: int  #: LOCAL_RANK
    world_size: int  #: WORLD_SIZE
    #: TRAININGRUN_CHAOS_KILL_AT_STEP (fault injection by `trainingrun local`): one worker SIGKILLs
    #: itself right after completing this step, a crash at a precise point for demos and tests.
    #: The variable holds one step per worker group ("300,450"): the group torchrun restarted in
    #: place N times (TORCHELASTIC_RESTART_COUNT) takes the N-th, so a resumed group does not
    #: kill itself again at a step its predecessor already died at.
    chaos_kill_at_step: Optional[int] = None
    #: TRAININGRUN_CHAOS_LOSE_NODE_AT_STEP (`trainingrun local --chaos-lose-node`, on one node): after this step the
    #: node's local rank 0 stops itself and says so, and `trainingrun local` kills the node (the first group only).
    chaos_lose_node_at_step: Optional[int] = None
    #: TORCHELASTIC_RESTART_COUNT: times torchrun restarted this worker group in place within the attempt.
    restart_count: int = 0
    #: TRAININGRUN_COMMITTED_STEP_FILE (set by the launcher): where local rank 0 writes each committed step.
    committed_step_file: Optional[str] = None
    #: TRAININGRUN_HANG_TIMEOUT_SECONDS (spec.recovery.hangTimeoutSeconds): None for auto, 0 for off (hangs.py).
    hang_timeout_seconds: Optional[float] = None
    #: TRAININGRUN_CHAOS_HANG (`trainingrun local --chaos-hang`), the first worker group only.
    chaos_hang: Optional[ChaosHang] = None
    #: TRAININGRUN_NODE_NAME (downward API spec.nodeName), "" where unknown.
    node_name: str = ""
    #: TRAININGRUN_SLOW_RANK_FACTOR (spec.recovery.slowRankFactor): 0 for off (stragglers.py).
    slow_rank_factor: float = DEFAULT_SLOW_RANK_FACTOR
    #: TRAININGRUN_CHAOS_SLOW_RANK (`trainingrun local --chaos-slow-rank`): (factor, rank), the first worker group only.
    chaos_slow_rank: Optional[tuple[float, int]] = None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def load_config(self) -> "RunConfig":
        """The run's config, TRAININGRUN_CONFIG: the one channel of the checkpoint URI into the process (the
        operator writes there the URI the run started with, which it keeps when spec.checkpoint.uri is edited
        mid-run). Everything in the process reads the URI from the config this returns, nowhere else."""
        from trainingrun_api.config import load_config

        return load_config(self.config_path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RunContext":
        env = os.environ if env is None else env

        def integer(name: str, default: Optional[int]) -> Optional[int]:
            raw = env.get(name)
            if raw in (None, ""):
                return default
            try:
                return int(raw)
            except ValueError:
                raise ContextError(f"environment variable {name}={raw!r} is not a whole number") from None

        config_path = env.get(contract.CONFIG)
        if not config_path:
            raise ContextError(
                "TRAININGRUN_CONFIG is not set: point it at a trainer config YAML "
                "(the operator mounts one; `trainingrun local FILE` sets it for you)"
            )
        return cls(
            name=env.get(contract.NAME, "local"),
            namespace=env.get(contract.NAMESPACE, "default"),
            uid=env.get(contract.UID, ""),
            attempt=integer(contract.ATTEMPT, 1) or 1,
            config_path=config_path,
            resume_from=env.get(contract.RESUME_FROM) or None,
            metrics_port=integer(contract.METRICS_PORT, None),
            pod_name=env.get(contract.POD_NAME) or env.get("HOSTNAME", "localhost"),
            rank=integer("RANK", 0) or 0,
            local_rank=integer("LOCAL_RANK", 0) or 0,
            world_size=integer("WORLD_SIZE", 1) or 1,
            chaos_kill_at_step=chaos_step(
                env.get(contract.CHAOS_KILL_AT_STEP, ""), integer("TORCHELASTIC_RESTART_COUNT", 0) or 0
            ),
            chaos_lose_node_at_step=(
                integer(contract.CHAOS_LOSE_NODE_AT_STEP, None)
                if (integer("TORCHELASTIC_RESTART_COUNT", 0) or 0) == 0
                else None
            ),
            restart_count=integer("TORCHELASTIC_RESTART_COUNT", 0) or 0,
            committed_step_file=env.get(contract.COMMITTED_STEP_FILE) or None,
            hang_timeout_seconds=hang_timeout(env.get(contract.HANG_TIMEOUT_SECONDS, "")),
            chaos_hang=(
                ChaosHang.parse(env[contract.CHAOS_HANG])
                if env.get(contract.CHAOS_HANG) and not (integer("TORCHELASTIC_RESTART_COUNT", 0) or 0)
                else None
            ),
            node_name=env.get(contract.NODE_NAME, ""),
            slow_rank_factor=slow_rank_factor(env.get(contract.SLOW_RANK_FACTOR, "")),
            chaos_slow_rank=(
                chaos_slow_rank(env[contract.CHAOS_SLOW_RANK], integer("WORLD_SIZE", 1) or 1)
                if env.get(contract.CHAOS_SLOW_RANK) and not (integer("TORCHELASTIC_RESTART_COUNT", 0) or 0)
                else None
            ),
        )
