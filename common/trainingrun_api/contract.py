"""The operator-trainer contract in one place: the environment a trainer container gets and the
progress report rank 0 sends. The operator's builders, its report endpoint, `trainingrun local` and
the trainer all import these names; neither side spells them out. Standard library only (no torch),
so the operator imports it too.

Reports: rank 0 POSTs a JSON `Report` to `TRAININGRUN_REPORT_URL` with `Authorization: Bearer <token>`,
the token read from `TRAININGRUN_REPORT_TOKEN_FILE` at every report (in a pod: a projected
ServiceAccount token whose audience is `REPORT_AUDIENCE`, which the kubelet rotates), TLS verified
with `TRAININGRUN_REPORT_CA_FILE` when set. The operator authenticates the token (TokenReview),
accepts a report only from a pod of the run's current attempt, checks every value, and alone writes
status. A report is sent every `TRAININGRUN_REPORT_INTERVAL_SECONDS` even when nothing changed (a
heartbeat), so the operator can tell a stalled trainer (reports, same step) from a reporting
outage (no reports).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

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


def memory_tier_dir(run: str, attempt: object, root: str = MEMORY_TIER_ROOT) -> str:
    """The memory tier of one attempt of a run (`run`: its uid). A restart inside the attempt finds it; a new attempt,
    which in a cluster is a new pod with an empty /dev/shm, does not (locally, `trainingrun local` removes it when the
    attempt ends). `attempt` "*" makes the glob of every attempt's."""
    return f"{root}/trainingrun-{run}-attempt-{attempt}"


# ---------------------------------------------------------------- the report endpoint

REPORT_PATH = "/v1/reports"
#: Audience of the projected token; a token for any other audience (the API server's included) is refused.
REPORT_AUDIENCE = "trainingrun.dev/report"
#: Where a pod's projected report token is mounted, and its file name.
REPORT_TOKEN_DIR = "/var/run/secrets/trainingrun.dev/report"
REPORT_TOKEN_PATH = f"{REPORT_TOKEN_DIR}/token"
#: Key of the report endpoint's CA certificate in the run's ConfigMap (mounted beside the config).
REPORT_CA_KEY = "report-ca.crt"
#: Bodies larger than this are refused unread.
MAX_REPORT_BYTES = 64 * 1024
DEFAULT_REPORT_INTERVAL_SECONDS = 10.0

#: Matched whole (`fullmatch`) and ASCII only: `\\d` alone takes other scripts' digits (which int() reads) and `$` a
#: trailing newline.
_CHECKPOINT_DIR = re.compile(r"step-([0-9]{8,19})", re.ASCII)
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})", re.ASCII
)
#: Printable ASCII: names, uids and process labels in a report.
_PRINTABLE = re.compile(r"[ -~]+", re.ASCII)
#: A report nests objects two deep; anything deeper is refused (and never recursed into).
MAX_REPORT_DEPTH = 4


class ReportError(ValueError):
    """A report that is not well formed; the message names the field."""


@dataclass
class Progress:
    step: int
    updated_at: str  #: when that step finished (RFC 3339)
    total_steps: Optional[int] = None
    loss: Optional[float] = None
    samples_per_second: Optional[float] = None
    productive_seconds: Optional[float] = None  #: step time kept in the model (data wait excluded), this run only
    model_flops_per_second: Optional[float] = None  #: over all ranks (`efficiency`)
    mfu: Optional[float] = None  #: model FLOP/s over every rank's peak; none on CPUs and unknown GPUs

    WIRE = {
        "step": "step",
        "updated_at": "updatedAt",
        "total_steps": "totalSteps",
        "loss": "loss",
        "samples_per_second": "samplesPerSecond",
        "productive_seconds": "productiveSeconds",
        "model_flops_per_second": "modelFlopsPerSecond",
        "mfu": "mfu",
    }


@dataclass
class ProcessTime:
    """Where one training process's time went since it started (rank 0's clock), cumulative: the parts of the goodput
    breakdown a process sees. A restarted worker group is a new `process`; what a killed one did after its last
    report is not here (the supervisor sees it as time outside processes)."""

    process: str  #: tells processes apart: pod, pid and start time
    alive_seconds: float  #: since the process started
    startup_seconds: float  #: process start to ready to train: imports, process group, model, data (restore excluded)
    restore_seconds: float  #: loading the checkpoint it resumed from
    checkpoint_seconds: float  #: the training thread blocked by saves, and steps slowed by a background save
    data_wait_seconds: float  #: steps waiting for their batches
    compute_seconds: float  #: every step it ran, data wait excluded: kept in the model or lost later
    eval_seconds: float  #: evaluations
    restored_productive_seconds: float  #: the run's productive seconds in the checkpoint it resumed from
    # The parts of startup_seconds (`timekeeping.STARTUP_PHASES`), and the first step (part of compute_seconds).
    imports_seconds: float = 0.0  #: interpreter start and imports
    init_seconds: float = 0.0  #: seeding, CUDA, the process group
    model_seconds: float = 0.0  #: building the model and optimizer
    data_seconds: float = 0.0  #: building the data
    prepare_seconds: float = 0.0  #: the rest before training: the checkpoint store, trackers
    first_step_seconds: float = 0.0  #: the first step: compile, warm-up

    WIRE = {
        "process": "process",
        "alive_seconds": "aliveSeconds",
        "startup_seconds": "startupSeconds",
        "restore_seconds": "restoreSeconds",
        "checkpoint_seconds": "checkpointSeconds",
        "data_wait_seconds": "dataWaitSeconds",
        "compute_seconds": "computeSeconds",
        "eval_seconds": "evalSeconds",
        "restored_productive_seconds": "restoredProductiveSeconds",
        "imports_seconds": "importsSeconds",
        "init_seconds": "initSeconds",
        "model_seconds": "modelSeconds",
        "data_seconds": "dataSeconds",
        "prepare_seconds": "prepareSeconds",
        "first_step_seconds": "firstStepSeconds",
    }

    #: Start-up to the first step, part by part (they add up to it): `startup_seconds`' phases, restore, the first step.
    STARTUP_PARTS = ("imports", "init", "model", "data", "prepare", "restore", "first_step")

    def startup_parts(self) -> dict[str, float]:
        """{part: seconds} of `STARTUP_PARTS`."""
        return {part: getattr(self, f"{part}_seconds") for part in self.STARTUP_PARTS}

    def plus(self, other: "ProcessTime", process: str = "ended") -> "ProcessTime":
        """Both processes' time together (the productive seconds they resumed from: the smaller)."""
        return ProcessTime(
            process,
            **{
                field: (min if field == "restored_productive_seconds" else float.__add__)(
                    float(getattr(self, field)), float(getattr(other, field))
                )
                for field in self.WIRE
                if field != "process"
            },
        )

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> "ProcessTime":
        """From the names on the wire (and in status.processTime); missing numbers are 0."""
        return cls(
            process=str(body.get("process") or ""),
            **{field: float(body.get(wire) or 0.0) for field, wire in cls.WIRE.items() if field != "process"},
        )


@dataclass
class IntervalChoice:
    """The checkpoint interval `checkpoint.interval.steps: auto` chose, and what it was made of."""

    steps: int  #: the interval, in steps
    seconds: Optional[float]  #: that many steps at the usual step time (None until steps were measured)
    save_cost_seconds: Optional[float]  #: what one save costs the training loop (None until one was measured)
    seconds_between_failures: float  #: the run's mean time between failures, as estimated now
    failures: int  #: restarts of the training processes seen so far
    expected_lost_seconds: Optional[float]  #: training a failure throws away, on average: half an interval

    WIRE = {
        "steps": "steps",
        "seconds": "seconds",
        "save_cost_seconds": "saveCostSeconds",
        "seconds_between_failures": "secondsBetweenFailures",
        "failures": "failures",
        "expected_lost_seconds": "expectedLostSeconds",
    }


@dataclass
class CommittedCheckpoint:
    uri: str  #: <checkpoint URI of the run>/step-NNNNNNNN
    step: int
    time: str
    sha256: Optional[str] = None  #: of the manifest

    WIRE = {"uri": "uri", "step": "step", "time": "time", "sha256": "sha256"}


@dataclass
class CheckpointInMemory:
    """Persisting behind: the newest checkpoint committed in the pod's memory, which storage may not hold yet (a
    restart of the workers inside the pod resumes from it; a new pod from lastGoodCheckpoint)."""

    step: int
    time: str

    WIRE = {"step": "step", "time": "time"}


@dataclass
class Report:
    """What rank 0 tells the operator: who it is, and progress and/or the last committed checkpoint."""

    namespace: str
    name: str
    uid: str
    attempt: int
    progress: Optional[Progress] = None
    last_good_checkpoint: Optional[CommittedCheckpoint] = None
    process_time: Optional[ProcessTime] = None
    checkpoint_interval: Optional[IntervalChoice] = None
    checkpoint_in_memory: Optional[CheckpointInMemory] = None

    def to_json(self) -> bytes:
        body = {
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
            "attempt": self.attempt,
            **self.status_fields(),
        }
        if self.process_time:
            body["processTime"] = wire(self.process_time)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Report":
        """Parse and check a report body; ReportError names the first field that is wrong."""
        if len(raw) > MAX_REPORT_BYTES:
            raise ReportError(f"the report is larger than {MAX_REPORT_BYTES} bytes")
        if _nesting(raw) > MAX_REPORT_DEPTH:
            raise ReportError(f"the report nests deeper than {MAX_REPORT_DEPTH} levels")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as error:
            raise ReportError(f"the report is not JSON: {str(error)[:200]}") from None
        if not isinstance(body, dict):
            raise ReportError("the report must be a JSON object")
        report = cls(
            namespace=_text(body, "namespace"),
            name=_text(body, "name"),
            uid=_text(body, "uid"),
            attempt=_integer(body, "attempt", minimum=1),
        )
        if body.get("progress") is not None:
            progress = _object(body, "progress")
            report.progress = Progress(
                step=_integer(progress, "step", "progress."),
                updated_at=_time(progress, "updatedAt", "progress."),
                total_steps=_integer(progress, "totalSteps", "progress.", optional=True),
                loss=_number(progress, "loss", "progress."),
                samples_per_second=_number(progress, "samplesPerSecond", "progress.", minimum=0),
                productive_seconds=_number(progress, "productiveSeconds", "progress.", minimum=0),
                model_flops_per_second=_number(progress, "modelFlopsPerSecond", "progress.", minimum=0),
                mfu=_number(progress, "mfu", "progress.", minimum=0),
            )
        if body.get("lastGoodCheckpoint") is not None:
            checkpoint = _object(body, "lastGoodCheckpoint")
            report.last_good_checkpoint = CommittedCheckpoint(
                uri=_text(checkpoint, "uri", "lastGoodCheckpoint.", limit=2048),
                step=_integer(checkpoint, "step", "lastGoodCheckpoint."),
                time=_time(checkpoint, "time", "lastGoodCheckpoint."),
                sha256=_sha256(checkpoint, "sha256", "lastGoodCheckpoint."),
            )
        if body.get("checkpointInMemory") is not None:
            in_memory = _object(body, "checkpointInMemory")
            report.checkpoint_in_memory = CheckpointInMemory(
                step=_integer(in_memory, "step", "checkpointInMemory."),
                time=_time(in_memory, "time", "checkpointInMemory."),
            )
        if body.get("processTime") is not None:
            times = _object(body, "processTime")
            report.process_time = ProcessTime(
                process=_text(times, "process", "processTime."),
                **{
                    field: _number(times, wire, "processTime.", minimum=0) or 0.0
                    for field, wire in ProcessTime.WIRE.items()
                    if field != "process"
                },
            )
        if body.get("checkpointInterval") is not None:
            interval = _object(body, "checkpointInterval")
            numbers = {
                field: _number(interval, wire, "checkpointInterval.", minimum=0)
                for field, wire in IntervalChoice.WIRE.items()
                if field not in ("steps", "failures")
            }
            between = numbers.pop("seconds_between_failures")
            if between is None:
                raise ReportError("checkpointInterval.secondsBetweenFailures must be a finite number >= 0")
            report.checkpoint_interval = IntervalChoice(
                steps=_integer(interval, "steps", "checkpointInterval.", minimum=1),
                failures=_integer(interval, "failures", "checkpointInterval."),
                seconds_between_failures=between,
                **numbers,
            )
        return report

    def status_fields(self) -> dict[str, Any]:
        """The TrainingRun status fields this report sets (progress, lastGoodCheckpoint, checkpointInMemory,
        checkpointInterval), as the CRD spells them."""
        fields: dict[str, Any] = {}
        if self.progress:
            fields["progress"] = wire(self.progress)
        if self.last_good_checkpoint:
            fields["lastGoodCheckpoint"] = wire(self.last_good_checkpoint)
        if self.checkpoint_in_memory:
            fields["checkpointInMemory"] = wire(self.checkpoint_in_memory)
        if self.checkpoint_interval:
            fields["checkpointInterval"] = wire(self.checkpoint_interval)
        return fields

    def refusal(self, namespace: str, name: str, uid: str, attempt: int, checkpoint_uri: str) -> Optional[str]:
        """Why this report cannot be taken for that run's current attempt (None when it can): another run or
        attempt, or a checkpoint that is not a step directory under the URI the run started with."""
        if (self.namespace, self.name, self.uid) != (namespace, name, uid):
            return f"the report is for {self.namespace}/{self.name} (uid {self.uid}), not this run"
        if self.attempt != attempt:
            return f"the report is for attempt {self.attempt}; the current attempt is {attempt}"
        checkpoint = self.last_good_checkpoint
        if checkpoint and checkpoint_step(checkpoint.uri, checkpoint_uri) != checkpoint.step:
            return (
                f"lastGoodCheckpoint.uri {checkpoint.uri} is not the step-{checkpoint.step:08d} directory under "
                f"the run's checkpoint URI {checkpoint_uri}"
            )
        return None


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


def with_estimates(previous: Optional[dict[str, Any]], progress: dict[str, Any]) -> dict[str, Any]:
    """`progress` (a status.progress dict) with percent done and the estimated completion time, from the step rate
    between the previous progress and this one: the operator's report endpoint and `trainingrun local` both. Without a rate (the first report, a resume below the previous step)
    the previous estimate is kept while the step stands, else there is none."""
    step, total = progress.get("step"), progress.get("totalSteps")
    if step is None or not total:
        return progress
    estimated = {**progress, "percent": round(100.0 * min(step, total) / total, 1)}
    now, before = parse_time(progress.get("updatedAt")), previous or {}
    then = parse_time(before.get("updatedAt"))
    if step >= total:
        estimated["estimatedCompletionTime"] = progress.get("updatedAt")
    elif now and then and isinstance(before.get("step"), int) and step > before["step"] and now > then:
        rate = (step - before["step"]) / (now - then).total_seconds()
        estimated["estimatedCompletionTime"] = rfc3339(now + timedelta(seconds=(total - step) / rate))
    elif step == before.get("step") and before.get("estimatedCompletionTime"):
        estimated["estimatedCompletionTime"] = before["estimatedCompletionTime"]
    elif before.get("estimatedCompletionTime"):
        estimated["estimatedCompletionTime"] = None  # a merge patch removes the stale one
    return estimated


def goodput(productive_seconds: float, wall_seconds: float) -> Optional[float]:
    """The one definition of goodput, for status, the trainer's metric and `trainingrun local`: step time kept in
    the model (progress.productiveSeconds: lost steps are not in it) / wall time since the run started (every
    attempt, restart and wait included). None before any wall time has passed."""
    if wall_seconds <= 0:
        return None
    return min(1.0, max(0.0, productive_seconds) / wall_seconds)


#: The goodput breakdown's parts, in the order they are shown; they add up to wall time.
BREAKDOWN = ("productive", "lost", "startup", "restore", "checkpoint", "data_wait", "eval", "backoff", "other")


def time_breakdown(
    wall_seconds: float, processes: list[ProcessTime], productive_seconds: float, backoff_seconds: float = 0.0
) -> dict[str, float]:
    """Where `wall_seconds` went, from the last report of each training process in that time (rank 0's), the run's
    productive seconds at its end and the time spent waiting out backoffs: {part: seconds} over BREAKDOWN.

    productive: step compute the model kept since the first process resumed; lost: step compute that a crash or a
    rollback threw away; startup: starting (and ending) processes, imports, rendezvous, model and data, and all time
    no training process reported (launchers, a killed process after its last report); restore, checkpoint (the
    training thread blocked, and the time a background save added to the steps beside it), data_wait, eval: as the
    processes measured them; other: what remains (logging, metrics, reporting between steps)."""

    def total(field: str) -> float:
        return float(sum(getattr(process, field) for process in processes))

    start = min((process.restored_productive_seconds for process in processes), default=productive_seconds)
    compute = total("compute_seconds")
    kept = min(compute, max(0.0, productive_seconds - start))
    parts = {
        "productive": kept,
        "lost": compute - kept,
        "startup": total("startup_seconds") + max(0.0, wall_seconds - backoff_seconds - total("alive_seconds")),
        "restore": total("restore_seconds"),
        "checkpoint": total("checkpoint_seconds"),
        "data_wait": total("data_wait_seconds"),
        "eval": total("eval_seconds"),
        "backoff": backoff_seconds,
    }
    parts["other"] = wall_seconds - sum(parts.values())
    return parts


def checkpoint_step(uri: str, run_uri: str) -> Optional[int]:
    """The step of `uri` when it is a checkpoint directory directly under `run_uri`, else None."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    match = _CHECKPOINT_DIR.fullmatch(name)
    return int(match.group(1)) if match and parent == run_uri.rstrip("/") else None


# ---------------------------------------------------------------- checks of single fields


def wire(value: Any) -> dict[str, Any]:
    """A contract dataclass as its wire names (None values left out)."""
    return {value.WIRE[k]: v for k, v in asdict(value).items() if v is not None}


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise ReportError(f"{key} must be an object")
    return value


def _nesting(raw: bytes) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside strings not counted), without parsing it: the
    parser recurses once per level."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _text(body: dict[str, Any], key: str, prefix: str = "", limit: int = 253) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value or len(value) > limit or not _PRINTABLE.fullmatch(value):
        raise ReportError(f"{prefix}{key} must be a non-empty string of at most {limit} printable ASCII characters")
    return value


def _integer(body: dict[str, Any], key: str, prefix: str = "", minimum: int = 0, optional: bool = False) -> Any:
    value = body.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**63:
        raise ReportError(f"{prefix}{key} must be a whole number from {minimum}")
    return value


def _number(body: dict[str, Any], key: str, prefix: str, minimum: Optional[float] = None) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (minimum is not None and value < minimum)
    ):
        raise ReportError(f"{prefix}{key} must be a finite number" + (f" >= {minimum}" if minimum is not None else ""))
    return float(value)


def _time(body: dict[str, Any], key: str, prefix: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not _TIME.fullmatch(value) or parse_time(value) is None:
        raise ReportError(f"{prefix}{key} must be an RFC 3339 time")
    return value


def _sha256(body: dict[str, Any], key: str, prefix: str) -> Optional[str]:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not _SHA256.fullmatch(value)):
        raise ReportError(f"{prefix}{key} must be 64 lowercase hex digits")
    return value
