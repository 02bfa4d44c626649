"""The operator-trainer contract in one place: the environment a trainer container gets, the report endpoint, and
the time helpers both sides use (the report itself is `progress_report`'s). The operator's builders, its report
endpoint, `trainingrun local` and the trainer all import these names; neither side spells them out. Standard library
only, so the operator imports it too.

Reports: rank 0 POSTs a JSON `progress_report.Report` to `TRAININGRUN_REPORT_URL` with `Authorization: Bearer <token>`,
the token read from `TRAININGRUN_REPORT_TOKEN_FILE` at every report (in a pod: a projected
ServiceAccount token whose audience is `REPORT_AUDIENCE`, which the kubelet rotates), TLS verified
with `TRAININGRUN_REPORT_CA_FILE` when set. The operator authenticates the token (TokenReview),
accepts a report only from a pod of the run's current attempt, checks every value, and alone writes
status. A report is sent every `TRAININGRUN_REPORT_INTERVAL_SECONDS` even when nothing changed (a
heartbeat), so the operator can tell a stalled trainer (reports, same step) from a reporting
outage (no reports).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from datetime import datetime, timezone
from typing import Optional

# ---------------------------------------------------------------- environment of a trainer container

NAME = "TRAININGRUN_NAME"
NAMESPACE = "TRAININGRUN_NAMESPACE"
UID = "TRAININGRUN_UID"
ATTEMPT = "TRAININGRUN_ATTEMPT"
CONFIG = "TRAININGRUN_CONFIG"  #: path of the trainer config file the operator mounts (CONFIG_FILE_NAME)
#: The trainer config as the operator writes it: JSON, read with json (config.load_config), so no YAML 1.1 reading
#: (1e-08 as a string, `on` as true) can change a value between the spec and the pod.
CONFIG_FILE_NAME = "config.json"
RESUME_FROM = "TRAININGRUN_RESUME_FROM"  #: the operator's last reported checkpoint: a floor, never a pin
METRICS_PORT = "TRAININGRUN_METRICS_PORT"
POD_NAME = "TRAININGRUN_POD_NAME"
#: The pod's IP: the address this pod's agent gives its peers (MASTER_ADDR when it is rank 0), so a replacement
#: pod is reachable at once instead of after its DNS record appears and its peers' cached "no such name" expires.
POD_IP = "TRAININGRUN_POD_IP"
#: Multi-pod runs: the pod that hosts the rendezvous store (`<job>-worker-0`). Its peers reach it through the
#: run's rendezvous Service (a stable address); that pod hosts the store on its own port.
RENDEZVOUS_HOST_POD = "TRAININGRUN_RENDEZVOUS_HOST_POD"
#: The rendezvous store's port: Kubeflow's default PyTorchJob port, which the builders also set explicitly.
RENDEZVOUS_PORT = 23456
REPORT_URL = "TRAININGRUN_REPORT_URL"
REPORT_TOKEN_FILE = "TRAININGRUN_REPORT_TOKEN_FILE"
REPORT_CA_FILE = "TRAININGRUN_REPORT_CA_FILE"
REPORT_INTERVAL_SECONDS = "TRAININGRUN_REPORT_INTERVAL_SECONDS"
#: `trainingrun local` fault injection: one step per worker group at which a worker kills itself.
CHAOS_KILL_AT_STEP = "TRAININGRUN_CHAOS_KILL_AT_STEP"
#: `trainingrun local --chaos-lose-node`: the step after which the node given it is lost as a node failure loses a pod
#: (its local rank 0 stops and says so; `trainingrun local` then SIGKILLs every process of it and starts a replacement).
CHAOS_LOSE_NODE_AT_STEP = "TRAININGRUN_CHAOS_LOSE_NODE_AT_STEP"
#: `trainingrun local --chaos-hang KIND:STEP[:RANK]`: after STEP one rank (the last by default) hangs, the first
#: worker group only: `stop` (SIGSTOP: it cannot answer), `block` (blocks for ever before the next collective),
#: `data` (its data loader blocks for ever at the next batch).
CHAOS_HANG = "TRAININGRUN_CHAOS_HANG"
#: What `--chaos-hang` can make a rank do.
CHAOS_HANG_KINDS = ("stop", "block", "data")
#: Beside the run's config: `--chaos-hang` fired in this invocation (a group restarted because a peer failed counts
#: no restart on its node, and would hang again); `trainingrun local` removes it when it starts.
CHAOS_HANG_FIRED_FILE = "chaos-hang-fired"
#: spec.recovery.hangTimeoutSeconds: `auto`, or seconds without progress that are a hang (0: off).
HANG_TIMEOUT_SECONDS = "TRAININGRUN_HANG_TIMEOUT_SECONDS"
#: spec.recovery.slowRankFactor: a rank this many times slower than the others is named a straggler (0: off).
SLOW_RANK_FACTOR = "TRAININGRUN_SLOW_RANK_FACTOR"
#: Its default, and the factors it may be besides 0 (the CRD, the spec model and the trainer check the same).
DEFAULT_SLOW_RANK_FACTOR = 1.5
SLOW_RANK_FACTORS = (1.1, 100.0)
#: `trainingrun local --chaos-slow-rank FACTOR[:RANK]`: RANK (the last by default) takes FACTOR times as long on each
#: step's part before its first collective, in the first worker group.
CHAOS_SLOW_RANK = "TRAININGRUN_CHAOS_SLOW_RANK"


def chaos_slow_rank(raw: str, ranks: int) -> tuple[float, int]:
    """(factor, rank) of `--chaos-slow-rank FACTOR[:RANK]` (CHAOS_SLOW_RANK), the last of `ranks` by default; ValueError
    saying what to write when it is not FACTOR above 1 and up to 100, and RANK from 0."""
    factor, _, rank = raw.partition(":")
    try:
        parsed = (float(factor), int(rank) if rank else ranks - 1)
    except ValueError:
        parsed = (0.0, -1)
    if not (1 < parsed[0] <= 100 and parsed[1] >= 0):
        raise ValueError("write FACTOR or FACTOR:RANK with FACTOR above 1 and up to 100, e.g. 3 or 3:0")
    return parsed


#: Set by the launcher for its workers when the rendezvous has a fixed endpoint (pods, `--nodes`): host:port of the
#: rendezvous store, which the host pod's agent serves, so the hang watch's exchange outlives any worker (hangs.py).
HANG_STORE = "TRAININGRUN_HANG_STORE"
#: The node the pod runs on (downward API spec.nodeName), to name it in a hang's diagnosis.
NODE_NAME = "TRAININGRUN_NODE_NAME"
#: Set by the launcher for its workers: the file where local rank 0 writes the newest committed step, so the agent
#: can tell a worker group that made progress before it failed from one that crash-loops (launch.RestartBudget).
COMMITTED_STEP_FILE = "TRAININGRUN_COMMITTED_STEP_FILE"
#: Every name above starts so; a user's env may not use it (validation refuses it).
PREFIX = "TRAININGRUN_"
#: Set by the user in spec.env (so outside PREFIX): grams of CO2 per kWh, for the trainer's emissions estimate.
GRID_INTENSITY = "GRID_INTENSITY_G_PER_KWH"
#: Where the trainer keeps the newest committed checkpoint in node memory (checkpoint.memoryTier): the pod's
#: memory-backed /dev/shm volume (resources.sharedMemory).
MEMORY_TIER_ROOT = "/dev/shm"
#: Another folder in node memory for it: the tests' own (each session one, so a test cleaning up never removes the
#: copies of another session or of a user's `trainingrun local` run on the same machine).
MEMORY_TIER_ROOT_ENV = "TRAININGRUN_MEMORY_TIER_ROOT"


def memory_tier_root() -> str:
    """MEMORY_TIER_ROOT, or the folder TRAININGRUN_MEMORY_TIER_ROOT names."""
    return os.environ.get(MEMORY_TIER_ROOT_ENV) or MEMORY_TIER_ROOT


#: What may name a run in node memory's folders: its uid (a UUID, as the API server sets it) or its name. A uid from a
#: user's file with '/' or '..' named, and removed, a folder outside the memory root.
RUN_KEY_PATTERN = r"[0-9A-Za-z][-0-9A-Za-z]{0,62}"


def memory_tier_dir(run: str, attempt: object, root: Optional[str] = None) -> str:
    """The memory tier of one attempt of a run (`run`: its uid). A restart inside the attempt finds it; a new attempt,
    which in a cluster is a new pod with an empty /dev/shm, does not (locally, `trainingrun local` removes it when the
    attempt ends). ValueError for a `run` that is not RUN_KEY_PATTERN."""
    if not re.fullmatch(RUN_KEY_PATTERN, run, re.ASCII):
        raise ValueError(
            f"{run[:80]!r} cannot name a run's node memory: a uid or name is at most 63 letters, digits and '-'"
        )
    return f"{root or memory_tier_root()}/trainingrun-{run}-attempt-{attempt}"


def memory_tier_key(run: str, checkpoint_uri: str) -> str:
    """What names a run's node memory: its uid (or name) and its checkpoint URI, so two runs of one name (scripts of
    one's own, whose TRAININGRUN_NAME defaults to the same) never share it."""
    return f"{run}-{hashlib.sha256(checkpoint_uri.encode()).hexdigest()[:8]}"


def memory_tier_dirs(run: str, root: Optional[str] = None) -> str:
    """The glob of every attempt's memory tier of `run`, what comes from input escaped."""
    return glob.escape(memory_tier_dir(run, "", root)) + "*"


# ---------------------------------------------------------------- the report endpoint

REPORT_PATH = "/v1/reports"
#: Audience of the projected token; a token for any other audience (the API server's included) is refused.
REPORT_AUDIENCE = "trainingrun.dev/report"
#: Where a pod's projected report token is mounted, and its file name.
REPORT_TOKEN_DIR = "/var/run/secrets/trainingrun.dev/report"
REPORT_TOKEN_PATH = f"{REPORT_TOKEN_DIR}/token"
#: File name of the report endpoint's CA certificate in the config volume (beside the config).
REPORT_CA_KEY = "report-ca.crt"
DEFAULT_REPORT_INTERVAL_SECONDS = 10.0

#: Matched whole (`fullmatch`) and ASCII only: `\\d` alone takes other scripts' digits (which int() reads) and `$` a
#: trailing newline.
_CHECKPOINT_DIR = re.compile(r"step-([0-9]{8,19})", re.ASCII)


def rfc3339(moment: datetime, fraction: bool = False) -> str:
    """A time as Kubernetes writes it (UTC, `Z`); with `fraction`, microseconds too (checkpoint manifests)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Optional[str]) -> Optional[datetime]:
    """An RFC 3339 time from status or a report; None when absent or malformed."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def checkpoint_step(uri: str, run_uri: str) -> Optional[int]:
    """The step of `uri` when it is a checkpoint directory directly under `run_uri`, else None."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    match = _CHECKPOINT_DIR.fullmatch(name)
    return int(match.group(1)) if match and parent == run_uri.rstrip("/") else None
