"""`trainingrun local FILE`: run a TrainingRun on this machine, supervised the way the operator would.

Each attempt is the same launcher a pod runs (`python -m trainingrun_trainer.launch`, torchrun's
elastic agent) with the same environment contract. The trainer reports progress and committed
checkpoints to a small status endpoint served here, exactly as it patches `status` in a cluster,
so the runner sees what the operator would: when an attempt dies it is classified (permanent,
preemption, failure), charged to the run's recovery budget, and a new attempt resumes from the last
good checkpoint after the backoff. Fault injection (`--chaos-kill-step`, `--chaos-kill-every`)
SIGKILLs a worker to show that this works.

The parts: `inputs` (the file, options and secrets), `ledger` (what a run keeps between invocations),
`status_server` (the report endpoint), `processes` (/proc and logs), `runner` (the supervisor), `display`.
"""

from .display import PlainDisplay, RichDisplay
from .inputs import (
    DEFAULT_RUNS_DIR,
    LocalOptionError,
    LocalOptions,
    LocalRunError,
    check_options,
    load_run,
    port_is_free,
    read_env_file,
    resolve_secrets,
    secret_variables,
)
from .ledger import RunLedger
from .processes import LogFollower, child_pids, own_command, worker_pids
from .runner import STOP_SIGNALS, Attempt, LocalRunner, WorkerGroup
from .status_server import StatusServer
from .summary import Summary

__all__ = [
    "DEFAULT_RUNS_DIR",
    "STOP_SIGNALS",
    "Attempt",
    "LocalOptionError",
    "LocalOptions",
    "LocalRunError",
    "LocalRunner",
    "own_command",
    "LogFollower",
    "PlainDisplay",
    "RichDisplay",
    "RunLedger",
    "StatusServer",
    "Summary",
    "WorkerGroup",
    "check_options",
    "child_pids",
    "load_run",
    "port_is_free",
    "read_env_file",
    "resolve_secrets",
    "secret_variables",
    "worker_pids",
]
