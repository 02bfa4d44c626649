"""What a local run starts from: the TrainingRun file (parsed as `validate` does, with what a laptop run may leave
out filled in), the command-line options, and the secrets it references (environment or .env, never printed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trainingrun_api import contract

from .. import api, validation
from ..api_meta import MAX_RUN_NAME_LENGTH, RUN_NAME_PATTERN
from .ledger import RunLedger, run_directory

DEFAULT_RUNS_DIR = "runs"
#: The most nodes `--nodes` simulates: each is a launcher and its workers on this machine's cores.
MAX_LOCAL_NODES = 8


class LocalRunError(Exception):
    """A problem found before anything started; the message says what to do."""


class LocalOptionError(LocalRunError):
    """A command-line option that cannot work (a usage error, exit code 2)."""


@dataclass
class LocalOptions:
    nproc: Optional[int] = None  #: processes (default: spec.nprocPerNode)
    #: Simulated nodes: one launcher each, as in pods of a cluster, with a folder of its own as its node memory and
    #: c10d rendezvous on 127.0.0.1 (1: one launcher, --standalone).
    nodes: int = 1
    checkpoint_uri: Optional[str] = None  #: default: file://./runs/<name>/checkpoints
    max_steps: Optional[int] = None  #: override spec.trainer.maxSteps
    chaos_kill_steps: list[int] = field(default_factory=list)  #: SIGKILL a worker when the run reaches each
    chaos_kill_every: Optional[float] = None  #: SIGKILL a random worker every N seconds
    #: With several nodes: lose the last node after this step as a node failure loses a pod (every process of it
    #: SIGKILLed, its node memory gone), and start a replacement, as Kubeflow recreates a lost pod.
    chaos_lose_node_step: Optional[int] = None
    #: KIND:STEP[:RANK]: after STEP, RANK (default the last) hangs (contract.CHAOS_HANG), the first worker group only.
    chaos_hang: Optional[str] = None
    #: FACTOR[:RANK]: RANK (default the last) is FACTOR times slower before each step's first collective
    #: (contract.CHAOS_SLOW_RANK), the first worker group only.
    chaos_slow_rank: Optional[str] = None
    metrics_port: Optional[int] = None  #: TRAININGRUN_METRICS_PORT for the trainer
    env_file: str = ".env"  #: where secrets come from when not in the environment
    runs_dir: str = DEFAULT_RUNS_DIR
    chaos_seed: int = 0


# ---------------------------------------------------------------- loading and secrets


def load_run(path: str, options: LocalOptions) -> api.TrainingRun:
    """Parse the file the way `validate` does, filling in what a laptop run may leave out."""
    documents = validation.load_file(path)
    if len(documents) != 1:
        raise validation.InvalidTrainingRun(
            [
                validation.Problem(
                    "", f"{path} holds {len(documents)} documents; `trainingrun local` runs one TrainingRun"
                )
            ]
        )
    document = documents[0]
    if isinstance(document, dict) and isinstance(document.get("spec"), dict):
        spec = document["spec"]
        name = str((document.get("metadata") or {}).get("name", "run"))
        for section in ("checkpoint", "trainer"):  # `checkpoint:` with nothing under it is YAML's null: no section
            if section in spec and spec[section] is None:
                spec[section] = {}
        checkpoint = spec.setdefault("checkpoint", {})
        if isinstance(checkpoint, dict):
            uri = (
                options.checkpoint_uri
                or checkpoint.get("uri")
                or f"file://{Path(options.runs_dir).resolve()}/{name}/checkpoints"
            )
            checkpoint["uri"] = uri
            if isinstance(document.get("metadata"), dict) and _plain_run_name(name):
                # Rerunning the command goes on with the same run (its goodput counts both invocations). Only for a
                # name validation takes: a folder below the runs directory is read, never one a name points at.
                document["metadata"].setdefault(
                    "uid", RunLedger.load(run_directory(Path(options.runs_dir), name, str(uri)), str(uri)).uid
                )
        # This machine is one node: a cluster file's several pods become one here, so a local file:// URI is fine.
        spec["replicas"] = {"min": 1}
        if options.max_steps is not None:
            trainer = spec.setdefault("trainer", {})
            if isinstance(trainer, dict):
                trainer["maxSteps"] = options.max_steps
    return validation.parse(document)


def _plain_run_name(name: str) -> bool:
    return len(name) <= MAX_RUN_NAME_LENGTH and re.fullmatch(RUN_NAME_PATTERN, name, re.ASCII) is not None


def check_options(run: api.TrainingRun, options: LocalOptions) -> None:
    """Options that could never do what they ask, refused before any process starts."""
    last = run.spec.trainer.max_steps
    late = sorted(step for step in options.chaos_kill_steps if step > last)
    if late:
        raise LocalOptionError(
            f"--chaos-kill-step {late[0]} is past the run's last step ({last}, "
            f"spec.trainer.maxSteps or --max-steps): it would never fire; pick a step up to {last}"
        )
    if options.chaos_lose_node_step is not None and options.chaos_lose_node_step > last:
        raise LocalOptionError(
            f"--chaos-lose-node {options.chaos_lose_node_step} is past the run's last step ({last}, "
            f"spec.trainer.maxSteps or --max-steps): it would never fire; pick a step up to {last}"
        )
    if options.chaos_hang is not None:
        processes = (options.nproc or run.spec.nproc_per_node) * options.nodes
        check_chaos_hang(options.chaos_hang, last, run.spec.recovery.hang_timeout_seconds, processes)
    if options.chaos_slow_rank is not None:
        processes = (options.nproc or run.spec.nproc_per_node) * options.nodes
        check_chaos_slow_rank(options.chaos_slow_rank, run.spec.recovery.slow_rank_factor, processes)
    if options.chaos_lose_node_step is not None and options.nodes < 2:
        raise LocalOptionError(
            "--chaos-lose-node loses one of several simulated nodes: add --nodes 2 (or more), or use --chaos-kill-step "
            "to kill a worker of one"
        )
    if not 1 <= options.nodes <= MAX_LOCAL_NODES:
        raise LocalOptionError(
            f"--nodes {options.nodes}: a local run simulates 1 to {MAX_LOCAL_NODES} nodes on this machine; pick one"
        )
    if options.nodes > 1 and options.metrics_port:
        raise LocalOptionError(
            "--metrics-port serves one launcher's metrics, and --nodes starts several on this machine: leave out one "
            "of them"
        )
    if options.metrics_port and not port_is_free(options.metrics_port):
        raise LocalOptionError(
            f"--metrics-port {options.metrics_port} is in use on this machine: pick a free port, "
            "or leave --metrics-port out (the run then serves no metrics)"
        )


CHAOS_HANG_KINDS = contract.CHAOS_HANG_KINDS


def check_chaos_hang(raw: str, last_step: int, hang_timeout: object, processes: int) -> None:
    parts = raw.split(":")
    kind, step, rank = parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "0"
    if kind not in CHAOS_HANG_KINDS or len(parts) > 3 or not step.isdigit() or not rank.isdigit() or int(step) < 1:
        raise LocalOptionError(
            f"--chaos-hang {raw}: write KIND:STEP or KIND:STEP:RANK with KIND one of {', '.join(CHAOS_HANG_KINDS)}, "
            "e.g. --chaos-hang stop:40"
        )
    if int(step) > last_step:
        raise LocalOptionError(
            f"--chaos-hang {raw}: step {step} is past the run's last step ({last_step}, spec.trainer.maxSteps or "
            f"--max-steps): it would never fire; pick a step up to {last_step}"
        )
    if int(rank) >= processes and len(parts) > 2:
        raise LocalOptionError(
            f"--chaos-hang {raw}: the run has ranks 0 to {processes - 1}; pick one of them, or leave RANK out (the last)"
        )
    if kind == "stop" and processes < 2:
        raise LocalOptionError(
            f"--chaos-hang {raw}: a stopped rank is found by the ranks still running, and this run has one process; "
            "add --nproc 2, or use block or data (the rank's own watch finds those)"
        )
    if hang_timeout == 0:
        raise LocalOptionError(
            f"--chaos-hang {raw}: spec.recovery.hangTimeoutSeconds is 0 (off), so the hang would never be found; "
            "remove it or set it to auto"
        )


def check_chaos_slow_rank(raw: str, slow_rank_factor: float, processes: int) -> None:
    try:
        parsed = contract.chaos_slow_rank(raw, processes)
    except ValueError as error:
        raise LocalOptionError(f"--chaos-slow-rank {raw}: {error}") from None
    if processes < 2:
        raise LocalOptionError(
            f"--chaos-slow-rank {raw}: a straggler is slower than the other ranks, and this run has one process; "
            "add --nproc 2"
        )
    if parsed[1] >= processes:
        raise LocalOptionError(
            f"--chaos-slow-rank {raw}: the run has ranks 0 to {processes - 1}; pick one of them, or leave RANK out "
            "(the last)"
        )
    if slow_rank_factor == 0:
        raise LocalOptionError(
            f"--chaos-slow-rank {raw}: spec.recovery.slowRankFactor is 0 (off), so the slow rank would never be "
            "named; remove it or set it to a factor such as 1.5"
        )


def port_is_free(port: int) -> bool:
    """Whether the trainer's metrics server could listen on `port` (it binds every interface, reusing TIME_WAIT)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines (# comments, optional quotes, optional `export`); a missing file is empty."""
    values: dict[str, str] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return values
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        if "=" not in line:
            raise LocalRunError(f"{path}:{number}: expected KEY=VALUE")  # never echo the line: it may hold a secret
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def secret_variables(spec: api.TrainingRunSpec) -> list[tuple[str, str]]:
    """(variable, what it stands for) for every secret the run references."""
    wanted = [(e.name, f"secrets.env {e.secret_name}/{e.key}") for e in spec.secrets.env]
    if spec.secrets.gcs_key_file:
        ref = spec.secrets.gcs_key_file
        wanted.append(
            (
                "GOOGLE_APPLICATION_CREDENTIALS",
                f"path of the key file for secrets.gcsKeyFile {ref.secret_name}/{ref.key}",
            )
        )
    s3 = spec.secrets.s3_credentials
    if s3:
        wanted += [
            ("AWS_ACCESS_KEY_ID", f"secrets.s3Credentials {s3.secret_name}/{s3.access_key_id_key}"),
            ("AWS_SECRET_ACCESS_KEY", f"secrets.s3Credentials {s3.secret_name}/{s3.secret_access_key_key}"),
        ]
        if s3.session_token_key:
            wanted.append(("AWS_SESSION_TOKEN", f"secrets.s3Credentials {s3.secret_name}/{s3.session_token_key}"))
    return wanted


def resolve_secrets(spec: api.TrainingRunSpec, environ: dict[str, str], env_file: str) -> dict[str, str]:
    """Values for the referenced secrets from the environment or the .env file; names only in errors."""
    from_file = read_env_file(env_file)
    values, missing = {}, []
    for variable, meaning in secret_variables(spec):
        value = environ.get(variable, from_file.get(variable))
        if value:
            values[variable] = value
        else:
            missing.append(f"{variable} ({meaning})")
    if missing:
        raise LocalRunError(
            "missing secrets: "
            + ", ".join(missing)
            + f"; set them in the environment or in {env_file} (see .env.example)"
        )
    return values
