"""Where a run is tracked (`spec.trainer.loggers`): TensorBoard, MLflow or Weights & Biases, each with the fields
its kind needs and no other."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from .model_base import CREDENTIALS_IN_URI, TRACKER_CREDENTIALS, ApiModel, kubernetes_validations, refuse_credentials

LoggerKind = Literal["tensorboard", "mlflow", "wandb"]


#: (kind, its required field, the field as written, what that field is): each kind's one required field.
#: What each kind of logger needs: (kind, field, its name on the wire, what it is).
LOGGER_NEEDS = (
    ("tensorboard", "log_dir", "logDir", "a path or gs://, s3:// URI for its event files"),
    ("mlflow", "tracking_uri", "trackingUri", "the MLflow tracking server, e.g. http://mlflow.mlflow:5000"),
    ("wandb", "project", "project", "the W&B project the run is logged to"),
)
#: The kinds of logger each field is for: (field, its name on the wire, kinds).
LOGGER_FIELD_KINDS = (
    ("log_dir", "logDir", ("tensorboard", "wandb")),
    ("tracking_uri", "trackingUri", ("mlflow",)),
    ("experiment", "experiment", ("mlflow",)),
    ("project", "project", ("wandb",)),
    ("entity", "entity", ("wandb",)),
)


def _only_for(wire: str, kinds: tuple[str, ...]) -> str:
    return f"{wire} is for {' and '.join(kinds)} loggers only; remove it"


class LoggerConfig(ApiModel):
    """An experiment tracker the trainer logs to: rank 0 only, from a background queue that never holds a step.

    One tracked run per TrainingRun across attempts and restarts; steps a resumed run computes again are not logged
    twice. Credentials come only from Secrets by reference (spec.secrets.env: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; WANDB_API_KEY; AWS_* or GOOGLE_APPLICATION_CREDENTIALS for
    a logDir in a bucket). W&B's own variables (WANDB_MODE=offline, WANDB_BASE_URL) go in spec.env.
    """

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": f"self.kind != '{kind}' || has(self.{wire})",
                    "message": f"a {kind} logger needs {wire}: {what}",
                }
                for kind, _, wire, what in LOGGER_NEEDS
            ]
            + [
                {"rule": f"self.kind in {list(kinds)} || !has(self.{wire})", "message": _only_for(wire, kinds)}
                for _, wire, kinds in LOGGER_FIELD_KINDS
            ]
            + [  # on the object, not the string: a rule on a string repeats its value in the server's error
                {
                    "rule": f"!has(self.{wire}) || !self.{wire}.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"{wire} {TRACKER_CREDENTIALS}",
                }
                for wire in ("logDir", "trackingUri")
            ]
        )
    )

    kind: LoggerKind = Field(
        description="tensorboard: event files under logDir; mlflow: a run on an MLflow "
        "tracking server; wandb: a run on Weights & Biases."
    )
    log_dir: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="tensorboard: the directory of this run's event files (a path, "
        "or a gs:// or s3:// URI through fsspec). Give each TrainingRun its own. wandb: W&B's local directory (a "
        "path; default the temporary directory), where offline runs (WANDB_MODE=offline) are kept.",
    )
    tracking_uri: Optional[str] = Field(
        default=None, min_length=1, max_length=1024, description="mlflow: the tracking server (http:// or https://)."
    )
    experiment: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="mlflow: the experiment the run is logged under "
        "(created when missing). Default: the TrainingRun's namespace.",
    )
    project: Optional[str] = Field(
        default=None, min_length=1, max_length=128, description="wandb: the project the run is logged to."
    )
    entity: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="wandb: the team or user that owns the project (default: the API key's user).",
    )

    @field_validator("log_dir", "tracking_uri", mode="before")
    @classmethod
    def _no_credentials(cls, value: Any) -> Any:
        return refuse_credentials(value, TRACKER_CREDENTIALS)

    @model_validator(mode="after")
    def _each_kind_its_fields(self) -> "LoggerConfig":
        for kind, field, wire, what in LOGGER_NEEDS:
            if self.kind == kind and getattr(self, field) is None:
                raise ValueError(f"a {kind} logger needs {wire}: {what}")
        for field, wire, kinds in LOGGER_FIELD_KINDS:
            if self.kind not in kinds and getattr(self, field) is not None:
                raise ValueError(_only_for(wire, kinds))
        return self
