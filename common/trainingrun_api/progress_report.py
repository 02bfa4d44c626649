"""The progress report rank 0 sends the operator (`Report`, POSTed to the report endpoint of `contract`), its
parts, and what the operator and `trainingrun local` derive from reports: percent done and the completion estimate,
goodput and the time breakdown.

A report's parts are pydantic models that check every value once, when the operator reads a report
(`Report.from_json`); the CRD's status models are generated from them (`trainingrun_operator.api.status_part`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Callable, ClassVar, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from .contract import checkpoint_step, parse_time
from .nesting import text_depth

#: Bodies larger than this are refused unread.
MAX_REPORT_BYTES = 64 * 1024
#: Matched whole (`fullmatch`) and ASCII only.
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


# ---------------------------------------------------------------- a report's values, each checked once


def _checked(check: Callable[[Any], bool], message: str) -> BeforeValidator:
    """A value that passes `check` as it is (no conversion: "2" is not 2, true is not 1), else `message`."""

    def validate(value: Any) -> Any:
        if not check(value):
            raise ValueError(message)
        return value

    return BeforeValidator(validate)


def _is_integer(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value < 2**63


def _is_number(value: Any, minimum: Optional[float]) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (minimum is None or value >= minimum)
    )


def _text(limit: int) -> BeforeValidator:
    return _checked(
        lambda v: isinstance(v, str) and 0 < len(v) <= limit and _PRINTABLE.fullmatch(v) is not None,
        f"must be a non-empty string of at most {limit} printable ASCII characters",
    )


Text = Annotated[str, _text(253)]  #: names, uids, process labels
UriText = Annotated[str, _text(2048)]
Count = Annotated[int, _checked(lambda v: _is_integer(v, 0), "must be a whole number from 0")]
Positive = Annotated[int, _checked(lambda v: _is_integer(v, 1), "must be a whole number from 1")]
Seconds = Annotated[float, _checked(lambda v: _is_number(v, 0), "must be a finite number >= 0")]
Finite = Annotated[float, _checked(lambda v: _is_number(v, None), "must be a finite number")]
Ratio = Seconds  #: the same check (a finite number >= 0), for a quotient
Time = Annotated[
    str,
    _checked(
        lambda v: isinstance(v, str) and _TIME.fullmatch(v) is not None and parse_time(v) is not None,
        "must be an RFC 3339 time",
    ),
]
Sha256 = Annotated[
    str, _checked(lambda v: isinstance(v, str) and _SHA256.fullmatch(v) is not None, "must be 64 lowercase hex digits")
]


class ReportPart(BaseModel):
    """A part of the report: camelCase on the wire, snake_case in Python; names it does not know are dropped (a newer
    trainer may send more). The trainer builds parts with `model_construct` (no checks: reporting never raises in
    the training loop); the operator reads them with `Report.from_json`, which checks every value once. The status
    model of the CRD is generated from these (`api.status_part`), so the two cannot drift apart."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def __init__(self, *values: Any, **fields: Any) -> None:
        """Checked; positional values fill the fields in the order they are declared."""
        super().__init__(**dict(zip(type(self).model_fields, values)), **fields)

    def to_wire(self) -> dict[str, Any]:
        """Its wire names and values, unset values left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Progress(ReportPart):
    """Training progress as last reported by rank 0."""

    step: Count = Field(description="Last completed optimizer step.")
    updated_at: Time = Field(description="When `step` finished, as rank 0 reported it (RFC 3339).")
    total_steps: Optional[Count] = Field(default=None, description="Steps the run trains for.")
    loss: Optional[Finite] = Field(default=None, description="Training loss at `step`.")
    samples_per_second: Optional[Seconds] = Field(default=None, description="Throughput over all ranks.")
    productive_seconds: Optional[Seconds] = Field(
        default=None,
        description="Step time kept in the current model, data wait excluded, summed over attempts (for goodput).",
    )
    model_flops_per_second: Optional[Seconds] = Field(
        default=None, description="The model's FLOP/s over all ranks: its FLOPs per sample x samples per second."
    )
    mfu: Optional[Seconds] = Field(
        default=None,
        description="Model FLOPs utilisation: modelFlopsPerSecond over every GPU's dense peak at the run's "
        "precision (0..1); absent on CPUs and GPUs the trainer's peak table lacks (spec.trainer.peakFlopsPerSecond).",
    )
    eval_loss: Optional[Finite] = Field(
        default=None, description="Mean loss on the held-out split at the last evaluation (spec.trainer.eval)."
    )
    eval_step: Optional[Count] = Field(default=None, description="The step of that evaluation.")


class ProcessTime(ReportPart):
    """Where one training process's time went since it started (rank 0's clock), cumulative: the parts of the goodput
    breakdown a process sees. A restarted worker group is a new `process`; what a killed one did after its last
    report is not here (the supervisor sees it as time outside processes)."""

    process: Text = Field(description="The process (pod/pid/start time), or 'ended' for the sum.")
    alive_seconds: Seconds = Field(default=0.0, description="Since the process started.")
    startup_seconds: Seconds = Field(
        default=0.0, description="Imports, process group, model and data before training (restore excluded)."
    )
    restore_seconds: Seconds = Field(default=0.0, description="Loading the checkpoint it resumed from.")
    checkpoint_seconds: Seconds = Field(
        default=0.0,
        description="The training thread blocked by saves, and the time a background save added to the "
        "steps beside it (not productive).",
    )
    data_wait_seconds: Seconds = Field(default=0.0, description="Steps waiting for their batches.")
    compute_seconds: Seconds = Field(default=0.0, description="Step time, data wait excluded: kept or lost later.")
    eval_seconds: Seconds = Field(default=0.0, description="Evaluations.")
    restored_productive_seconds: Seconds = Field(
        default=0.0,
        description="The run's productive seconds in the checkpoint it resumed from (the sum: the smallest).",
    )
    # The parts of startup_seconds (`timekeeping.STARTUP_PHASES`), and the first step (part of compute_seconds).
    imports_seconds: Seconds = Field(default=0.0, description="Of startupSeconds: interpreter start and imports.")
    init_seconds: Seconds = Field(default=0.0, description="Of startupSeconds: seeding, CUDA and the process group.")
    model_seconds: Seconds = Field(default=0.0, description="Of startupSeconds: building the model and optimizer.")
    data_seconds: Seconds = Field(default=0.0, description="Of startupSeconds: building the data.")
    prepare_seconds: Seconds = Field(
        default=0.0, description="Of startupSeconds: the rest before training (checkpoint store, trackers)."
    )
    first_step_seconds: Seconds = Field(
        default=0.0, description="The first step (torch.compile compiling, CUDA warming up); part of computeSeconds."
    )
    trained_samples: Seconds = Field(
        default=0.0,
        description="Samples its steps trained over all ranks, kept or lost: over computeSeconds and "
        "dataWaitSeconds, the average throughput.",
    )
    hang_seconds: Seconds = Field(
        default=0.0, description="No progress before a hang was found and diagnosed (the trainer's hangs.py)."
    )

    #: Start-up to the first step, part by part (they add up to it): `startup_seconds`' phases, restore, the first step.
    STARTUP_PARTS: ClassVar[tuple[str, ...]] = ("imports", "init", "model", "data", "prepare", "restore", "first_step")

    def startup_parts(self) -> dict[str, float]:
        """{part: seconds} of `STARTUP_PARTS`."""
        return {part: getattr(self, f"{part}_seconds") for part in self.STARTUP_PARTS}

    def plus(self, other: "ProcessTime", process: str = "ended") -> "ProcessTime":
        """Both processes' time together (the productive seconds they resumed from: the smaller)."""
        values: dict[str, Any] = {
            field: (min if field == "restored_productive_seconds" else float.__add__)(
                float(getattr(self, field)), float(getattr(other, field))
            )
            for field in ProcessTime.model_fields
            if field != "process"
        }
        return ProcessTime.model_construct(process=process, **values)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> "ProcessTime":
        """From status.processTime as the operator wrote it (missing numbers are 0)."""
        values: dict[str, Any] = {
            field: float(body.get(info.alias or field) or 0.0)
            for field, info in cls.model_fields.items()
            if field != "process"
        }
        return cls.model_construct(process=str(body.get("process") or ""), **values)


class IntervalChoice(ReportPart):
    """With checkpoint.interval.steps: auto, the interval rank 0 chose at its last report, and what it is made of:
    steps = sqrt(2 x saveCostSeconds x secondsBetweenFailures) / the usual step time, within minSteps..maxSteps. With
    checkpoint.storageInterval.steps: auto, the same for copies to storage: storageSteps = sqrt(2 x
    persistCostSeconds x secondsBetweenPodLosses) / the usual step time."""

    steps: Optional[Positive] = Field(
        default=None, description="The interval, in steps (absent unless checkpoint.interval.steps is auto)."
    )
    seconds: Optional[Seconds] = Field(default=None, description="That many steps at the usual step time.")
    save_cost_seconds: Optional[Seconds] = Field(
        default=None,
        description="What one save costs the training loop: blocking plus the slowdown of the steps "
        "beside the background write (the median of the last saves).",
    )
    seconds_between_failures: Seconds = Field(
        description="The run's mean time between failures as estimated now: the seconds since the run started / "
        "failures; before the first, expectedSecondsBetweenFailures or the time run so far, when longer."
    )
    failures: Count = Field(default=0, description="Restarts of the training processes seen so far.")
    expected_lost_seconds: Optional[Seconds] = Field(
        default=None, description="Training a failure throws away, on average: half an interval."
    )
    storage_steps: Optional[Positive] = Field(
        default=None,
        description="With storageInterval.steps: auto, how many steps apart checkpoints in memory are copied to "
        "storage now (absent: every one, at storage's pace, until a copy's cost is measured).",
    )
    persist_cost_seconds: Optional[Seconds] = Field(
        default=None,
        description="What one copy to storage costs the training loop: the slowdown of the steps beside it (the "
        "median of the last copies).",
    )
    seconds_between_pod_losses: Optional[Seconds] = Field(
        default=None,
        description="The run's mean time between failures that lose the node's memory (new attempts), estimated as "
        "secondsBetweenFailures is.",
    )


class CommittedCheckpoint(ReportPart):
    """The newest checkpoint whose manifest was committed."""

    uri: UriText = Field(description="URI of the checkpoint directory: <checkpoint URI of the run>/step-NNNNNNNN.")
    step: Count = Field(description="Step the checkpoint holds.")
    time: Time = Field(description="When it was committed (RFC 3339).")
    sha256: Optional[Sha256] = Field(default=None, description="SHA-256 of its manifest.")


class CheckpointInMemory(ReportPart):
    """Persisting behind: the newest checkpoint committed in the pods' memory, which storage may not hold yet (a
    restart of the workers inside a pod resumes from it, and with several pods a replacement pod from a surviving
    pod's memory; a new attempt from lastGoodCheckpoint)."""

    step: Count = Field(description="Step the checkpoint holds.")
    time: Time = Field(description="When it was committed in memory (RFC 3339).")


#: The most pods a report names as short of memory (a 64-pod run names all of its pods; more are cut).
MAX_PODS_NAMED = 64


class MemoryShort(ReportPart):
    """The pods whose memory had no room for the last checkpoint (its files, or with several pods the other pods'
    files too): restarts there read it from storage; none, once a checkpoint fits again."""

    pods: list[Text] = Field(
        max_length=MAX_PODS_NAMED,
        description="Pods whose /dev/shm lacked room for the checkpoint at `step` (empty: every pod holds it).",
    )
    step: Count = Field(description="The step of the checkpoint that found them short (or that fit again).")


#: The most characters of a hang's one-line diagnosis; the trainer cuts a longer one.
MAX_DIAGNOSIS_LENGTH = 1000


class Hang(ReportPart):
    """The last hang a rank of the run diagnosed (the trainer's hangs.py): no step progress for
    spec.recovery.hangTimeoutSeconds, and what held the run up. Sent by the rank that diagnosed it, which may be
    any rank."""

    step: Count = Field(description="The last step completed before the hang.")
    time: Time = Field(description="When it was diagnosed (RFC 3339).")
    diagnosis: Annotated[str, _text(MAX_DIAGNOSIS_LENGTH)] = Field(
        description="The collective that did not complete and the ranks that held it up, with their pods, nodes and "
        "where they were (or that they did not answer). The whole diagnosis is in the pod's log (`hang diagnosis:`)."
    )
    ranks: list[Count] = Field(
        default_factory=list,
        max_length=MAX_PODS_NAMED,
        description="The ranks named as holding it up (none: every rank waited, the transport hangs).",
    )
    nodes: list[Text] = Field(
        default_factory=list,
        max_length=MAX_PODS_NAMED,
        description="The nodes of the ranks named, where known: a node named in two hangs in a row is avoided.",
    )


class SlowRank(ReportPart):
    """A straggler (the trainer's stragglers.py): a rank whose own part of each step (its data wait and forward
    passes, before the step's first collective) took spec.recovery.slowRankFactor times the other ranks' median or
    more, for 30 s in a row, while every other rank waited for it. Rank 0 sends it when it names a rank, and again
    without `rank` once none is slow any more."""

    rank: Optional[Count] = Field(default=None, description="The slow rank (absent: no rank is slow now).")
    pod: Optional[Text] = Field(default=None, description="Its pod, as the rank said at start (absent: unknown).")
    node: Optional[Text] = Field(default=None, description="Its node (absent: unknown).")
    ratio: Ratio = Field(description="The slowest rank's time over the other ranks' median (1: every rank alike).")
    seconds: Seconds = Field(description="The slowest rank's time a step (its median over the last steps).")
    median_seconds: Seconds = Field(description="The other ranks' median time a step.")
    factor: Ratio = Field(description="spec.recovery.slowRankFactor.")
    step: Count = Field(description="The step at which the rank was named (or none was any more).")

    def words(self) -> str:
        """ "rank 1 (pod p, node n) takes 2.0x the other ranks' time before each step's collectives (0.41 s vs
        0.2 s, since step 120)", or that no rank is slow."""
        if self.rank is None:
            return f"no rank is {self.factor:g}x slower than the others any more (since step {self.step})"
        where = ", ".join(f"{kind} {name}" for kind, name in (("pod", self.pod), ("node", self.node)) if name)
        return (
            f"rank {self.rank}{f' ({where})' if where else ''} takes {self.ratio:.3g}x the other ranks' time before "
            f"each step's collectives ({self.seconds:.3g} s vs {self.median_seconds:.3g} s, since step {self.step}); "
            "every rank waits for it"
        )


#: The parts of a report that become status fields, by wire name.
STATUS_PARTS = (
    "progress",
    "lastGoodCheckpoint",
    "checkpointInMemory",
    "checkpointInterval",
    "checkpointMemoryShort",
    "lastHang",
    "slowRank",
)


class Report(ReportPart):
    """What rank 0 tells the operator: who it is, and progress and/or the last committed checkpoint."""

    namespace: Text
    name: Text
    uid: Text
    attempt: Positive
    progress: Optional[Progress] = None
    last_good_checkpoint: Optional[CommittedCheckpoint] = None
    process_time: Optional[ProcessTime] = None
    checkpoint_interval: Optional[IntervalChoice] = None
    checkpoint_in_memory: Optional[CheckpointInMemory] = None
    checkpoint_memory_short: Optional[MemoryShort] = None
    last_hang: Optional[Hang] = None
    slow_rank: Optional[SlowRank] = None

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Report":
        """Parse and check a report body, every value once; ReportError names the first field that is wrong."""
        if len(raw) > MAX_REPORT_BYTES:
            raise ReportError(f"the report is larger than {MAX_REPORT_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "\0"
        if "\0" in text:  # JSON never holds a raw NUL; UTF-16 and -32, which json.loads takes and the scan misreads, do
            raise ReportError("the report is not UTF-8 JSON")
        if text_depth(raw, stop_above=MAX_REPORT_DEPTH) > MAX_REPORT_DEPTH:
            raise ReportError(f"the report nests deeper than {MAX_REPORT_DEPTH} levels")
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise ReportError(f"the report is not JSON: {str(error)[:200]}") from None
        if not isinstance(body, dict):
            raise ReportError("the report must be a JSON object")
        try:
            return cls.model_validate(body, by_alias=True, by_name=False)
        except ValidationError as error:
            raise ReportError(_first_problem(error)) from None

    def status_fields(self) -> dict[str, Any]:
        """The TrainingRun status fields this report sets (progress, lastGoodCheckpoint, checkpointInMemory,
        checkpointInterval), as the CRD spells them."""
        body = self.to_wire()
        return {name: body[name] for name in STATUS_PARTS if name in body}

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


def _first_problem(error: ValidationError) -> str:
    """The first problem of a report, as `<field path> <what is wrong>` in wire names."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the report"
    if first["type"] == "value_error":
        return f"{where} {first['ctx']['error']}"
    if first["type"] == "missing":
        return f"{where} is missing"
    if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"{where} must be an object"
    return f"{where}: {first['msg']}"


# ---------------------------------------------------------------- checks of single fields
