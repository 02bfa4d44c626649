"""The TrainingRun's status (trainingrun.dev/v1alpha1, part of the API with api.py's spec): what the operator writes
and `kubectl get` and `trainingrun follow` show. The parts the trainer reports (progress, checkpoints, process time,
the chosen checkpoint interval) are generated from the report's own models (`progress_report`), so a report is
checked once and status cannot drift from it."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, create_model

from trainingrun_api import progress_report
from trainingrun_api.model_base import ApiModel

from . import kube_shapes

Phase = Literal["Pending", "Running", "Recovering", "Suspended", "Succeeded", "Failed"]


def status_part(part: type[progress_report.ReportPart], name: str, **derived: Any) -> type[ApiModel]:
    """The status model of a report part (`contract`), generated from it so the two cannot drift apart: the same
    names and descriptions, each optional (status may hold what an older trainer reported; a field with a default
    keeps it), plus the fields the operator `derived` itself. A report is checked once, by the contract's model;
    status is written from that."""
    fields: dict[str, Any] = {}
    for field, info in part.model_fields.items():
        kept = not info.is_required() and info.default is not None
        annotation = info.annotation if kept else Optional[info.annotation]
        fields[field] = (annotation, Field(default=info.default if kept else None, description=info.description))
    model: type[ApiModel] = create_model(name, __base__=ApiModel, __doc__=part.__doc__, **fields, **derived)
    return model


Progress = status_part(
    progress_report.Progress,
    "Progress",
    percent=(
        Optional[float],
        Field(default=None, description="step / totalSteps in percent (the operator computes it from the report)."),
    ),
    estimated_completion_time=(
        Optional[str],
        Field(
            default=None,
            description="When the run reaches totalSteps at the step rate between the last two reports "
            "of this attempt (RFC 3339; the operator computes it).",
        ),
    ),
)

#: Progress fields the operator derives from reports; a report cannot set them.
DERIVED_PROGRESS_FIELDS = ("percent", "estimatedCompletionTime")

CheckpointRef = status_part(progress_report.CommittedCheckpoint, "CheckpointRef")
CheckpointInMemoryRef = status_part(progress_report.CheckpointInMemory, "CheckpointInMemoryRef")
MemoryShortRef = status_part(progress_report.MemoryShort, "MemoryShortRef")
HangRef = status_part(progress_report.Hang, "HangRef")
SlowRankRef = status_part(progress_report.SlowRank, "SlowRankRef")


class HangNodes(ApiModel):
    """The nodes of the last hang the operator looked at, to find a node named in two hangs in a row."""

    time: Optional[str] = Field(default=None, description="lastHang.time of that hang.")
    nodes: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list, max_length=progress_report.MAX_PODS_NAMED, description="Its lastHang.nodes."
    )


class Restarts(ApiModel):
    """Attempts restarted, by cause, and pods restarted within attempts."""

    failures: int = Field(default=0, description="Attempts lost to application failures and stalls.")
    preemptions: int = Field(default=0, description="Attempts lost to preemption or eviction.")
    total: int = Field(default=0, description="failures + preemptions.")
    in_place: int = Field(
        default=0,
        description="Times pods were replaced within an attempt (a pod deleted, evicted or exited retryably) by "
        "Kubeflow's operator or, with a JobSet, the Job controller; they rejoin and resume from the last checkpoint, "
        "no new attempt is charged.",
    )
    last_in_place_time: Optional[str] = Field(
        default=None, description="When the PyTorchJob last reported Restarting (RFC 3339): the last restart counted."
    )
    attempt_pods_failed: Optional[int] = Field(
        default=None,
        description="JobSet backend: the current attempt's failed (and replaced) pods as its Job counts them, all "
        "already counted in inPlace.",
    )
    backoff_seconds: float = Field(default=0.0, description="Seconds of backoff before the attempts after the first.")


ProcessTimes = status_part(progress_report.ProcessTime, "ProcessTimes")


class TimeAccount(ApiModel):
    """The operator's account of the processes' time, kept across processes: one that reports after another adds
    the other's last report to `ended`."""

    ended: Optional[ProcessTimes] = Field(default=None, description="Processes of this run that ended, summed.")  # type: ignore[valid-type]  # generated (status_part)
    current: Optional[ProcessTimes] = Field(default=None, description="The newest report's process.")  # type: ignore[valid-type]  # generated (status_part)


class TimeBreakdown(ApiModel):
    """The run's wall time since startTime, at the last report, by part; the parts add up to wallSeconds."""

    wall_seconds: float = Field(default=0.0, description="From startTime to the last report.")
    productive_seconds: float = Field(default=0.0, description="Step compute kept in the model.")
    lost_seconds: float = Field(default=0.0, description="Step compute thrown away by crashes and rollbacks.")
    startup_seconds: float = Field(
        default=0.0,
        description="Starting processes (imports, rendezvous, model, data) and every moment no training "
        "process reported: scheduling, image pulls, pods restarting, a killed process after its last report.",
    )
    restore_seconds: float = Field(default=0.0, description="Loading checkpoints.")
    checkpoint_seconds: float = Field(default=0.0, description="Training blocked by saves.")
    data_wait_seconds: float = Field(default=0.0, description="Steps waiting for input.")
    eval_seconds: float = Field(default=0.0, description="Evaluations.")
    hang_seconds: float = Field(
        default=0.0, description="Hangs: from the last step before one to its diagnosis (spec.recovery)."
    )
    backoff_seconds: float = Field(default=0.0, description="Waiting out backoffs between attempts.")
    other_seconds: float = Field(default=0.0, description="The rest: logging, metrics and reporting between steps.")


CheckpointIntervalChoice = status_part(progress_report.IntervalChoice, "CheckpointIntervalChoice")


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type, e.g. Ready, SecretMissing.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: Optional[str] = Field(default=None, description="CamelCase reason for the last transition.")
    message: Optional[str] = Field(default=None, description="Human-readable details.")
    last_transition_time: Optional[str] = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: Optional[int] = Field(default=None, description="Spec generation the condition is based on.")


class TrainingRunStatus(ApiModel):
    """Observed state, written by the operator alone (progress and checkpoints as rank 0 reported them to it)."""

    phase: Optional[Phase] = Field(
        default=None, description="Pending, Running, Recovering, Suspended, Succeeded or Failed."
    )
    attempt: Optional[int] = Field(default=None, description="Current attempt number, from 1.")
    job_name: Optional[str] = Field(default=None, description="PyTorchJob or JobSet of the current attempt.")
    backend: Optional[str] = Field(
        default=None, description="What the run's attempts are (PyTorchJob or JobSet), decided at its first attempt."
    )
    start_time: Optional[str] = Field(default=None, description="When the first attempt started (RFC 3339).")
    attempt_start_time: Optional[str] = Field(default=None, description="When the current attempt started (RFC 3339).")
    next_attempt_time: Optional[str] = Field(
        default=None, description="While Recovering or Suspended-then-resumed: when the next attempt starts (RFC 3339)."
    )
    checkpoint_uri: Optional[str] = Field(
        default=None, description="The checkpoint URI the run started with; it cannot change while the run is active."
    )
    completion_time: Optional[str] = Field(default=None, description="When the run succeeded or failed (RFC 3339).")
    progress: Optional[Progress] = Field(default=None, description="Training progress.")  # type: ignore[valid-type]  # generated (status_part)
    last_good_checkpoint: Optional[CheckpointRef] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None, description="Newest committed checkpoint in storage: where a new attempt resumes from."
    )
    checkpoint_in_memory: Optional[CheckpointInMemoryRef] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None,
        description="With checkpoint.persistBehind: the newest checkpoint committed in the pods' memory "
        "(ahead of lastGoodCheckpoint until storage holds it; a restart of the workers inside a pod resumes from it, "
        "and with several pods a replacement for a lost pod from a surviving pod's memory; a new attempt from "
        "lastGoodCheckpoint). Cleared when an attempt starts: new pods' memory is empty.",
    )
    checkpoint_memory_short: Optional[MemoryShortRef] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None,
        description="The pods whose memory (/dev/shm, resources.sharedMemory) had no room for the last checkpoint: "
        "restarts there read it from storage, and with several pods checkpoints commit to storage (condition "
        "CheckpointMemoryShort). Cleared when an attempt starts.",
    )
    last_hang: Optional[HangRef] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None,
        description="The last hang a rank diagnosed: no step progress for recovery.hangTimeoutSeconds, the "
        "collective that did not complete and the ranks that held it up (condition Hung while the run has not "
        "trained past it; `kubectl logs` shows the whole diagnosis as `hang diagnosis:` lines).",
    )
    slow_rank: Optional[SlowRankRef] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None,
        description="A straggler rank 0 named: a rank whose part of each step before its first collective took "
        "recovery.slowRankFactor times the other ranks' or more, for 30 s in a row (condition SlowRank; `rank` "
        "absent: none is now). Cleared when an attempt starts.",
    )
    hang_nodes: Optional[HangNodes] = Field(
        default=None, description="The nodes the last hang named, as the operator last looked at it (lastHang.time)."
    )
    avoided_nodes: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list,
        max_length=kube_shapes.MAX_AVOIDED_NODES,
        description="Nodes named in two hangs in a row: the attempt then ended, and later attempts' pods do not run "
        "there (a node affinity on metadata.name). Remove a node from it (kubectl edit --subresource status) once "
        "it is repaired.",
    )
    last_report_time: Optional[str] = Field(
        default=None,
        description="When the operator last accepted a report from the current attempt (RFC 3339); "
        "rank 0 reports every 10 s, also when nothing changed.",
    )
    restarts: Optional[Restarts] = Field(default=None, description="Restarts by cause.")
    goodput: Optional[float] = Field(
        default=None, description="Productive step time kept in the model divided by wall time since start."
    )
    time_breakdown: Optional[TimeBreakdown] = Field(
        default=None, description="Where the run's wall time went, at the last report (goodput's decomposition)."
    )
    process_time: Optional[TimeAccount] = Field(
        default=None, description="The training processes' own account of their time, from their reports."
    )
    checkpoint_interval: Optional[CheckpointIntervalChoice] = Field(  # type: ignore[valid-type]  # generated (status_part)
        default=None, description="The checkpoint interval chosen by checkpoint.interval.steps: auto."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions, one per type.")
    observed_generation: Optional[int] = Field(default=None, description="Spec generation last acted on.")
