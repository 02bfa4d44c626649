"""Operator settings: every startup option in one place, read from the environment.

The Helm chart sets these variables on the operator Deployment; `trainingrun render` uses the
defaults unless the same variables are set in the shell.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import __version__


@dataclass(frozen=True)
class Settings:
    """How the operator renders children. Field by field:"""

    #: Image used when a TrainingRun has no `spec.image` (TRAININGRUN_TRAINER_IMAGE).
    default_trainer_image: str = f"ghcr.io/trainingrun-dev/trainer:{__version__}"
    #: UID and GID trainer containers run as; the trainer image creates this user (TRAININGRUN_TRAINER_UID).
    trainer_uid: int = 1000
    #: Where the run's ConfigMap is mounted in trainer containers.
    config_dir: str = "/etc/trainingrun"
    #: Where a GCS key-file Secret is mounted.
    gcs_key_dir: str = "/var/run/secrets/trainingrun/gcs"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            default_trainer_image=env.get("TRAININGRUN_TRAINER_IMAGE", defaults.default_trainer_image),
            trainer_uid=int(env.get("TRAININGRUN_TRAINER_UID", defaults.trainer_uid)),
        )

    @property
    def config_path(self) -> str:
        return f"{self.config_dir}/config.yaml"
