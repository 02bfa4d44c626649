"""What the trainer containers get in their environment (part of the TrainingRun spec, api.py): credentials by
reference only (a Secret's name and key; the operator never reads a value) and plain variables."""

from __future__ import annotations

from typing import Optional

from pydantic import Field
from pydantic.json_schema import JsonDict

from trainingrun_api.model_base import ApiModel

from .kube_shapes import DNS_SUBDOMAIN

#: A Secret (or ConfigMap) key: letters, digits, '-', '_', '.'; not '.', '..' or anything starting with '..'.
SECRET_KEY = r"^([-_a-zA-Z0-9]|\.[-_a-zA-Z0-9])[-._a-zA-Z0-9]*$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Lists of named items are maps for the API server: it rejects a name given twice.
LIST_MAP_BY_NAME: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}


class SecretKeyRef(ApiModel):
    """One key of a Secret in the run's namespace. The operator never reads its value."""

    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    key: str = Field(pattern=SECRET_KEY, min_length=1, max_length=253, description="Key within the Secret.")


class S3Credentials(ApiModel):
    """A Secret with S3 access keys, exposed to the trainer as AWS_* variables."""

    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    access_key_id_key: str = Field(
        default="AWS_ACCESS_KEY_ID", pattern=SECRET_KEY, max_length=253, description="Key holding the access key id."
    )
    secret_access_key_key: str = Field(
        default="AWS_SECRET_ACCESS_KEY",
        pattern=SECRET_KEY,
        max_length=253,
        description="Key holding the secret access key.",
    )
    session_token_key: Optional[str] = Field(
        default=None, pattern=SECRET_KEY, max_length=253, description="Key holding a session token, if any."
    )


class SecretEnv(ApiModel):
    """An environment variable whose value comes from a Secret key (tracker API keys and the like)."""

    name: str = Field(pattern=ENV_NAME, max_length=128, description="Variable name, e.g. WANDB_API_KEY.")
    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    key: str = Field(pattern=SECRET_KEY, min_length=1, max_length=253, description="Key within the Secret.")


class Secrets(ApiModel):
    """Credentials by reference only. With neither storage secret, pods use workload identity."""

    gcs_key_file: Optional[SecretKeyRef] = Field(
        default=None,
        description="A GCP service-account key file; mounted read-only and named by GOOGLE_APPLICATION_CREDENTIALS.",
    )
    s3_credentials: Optional[S3Credentials] = Field(
        default=None, description="S3 access keys, passed as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."
    )
    env: list[SecretEnv] = Field(
        default_factory=list,
        max_length=64,
        description="More variables from Secret keys.",
        json_schema_extra=LIST_MAP_BY_NAME,
    )

    def secret_names(self) -> list[str]:
        """Every Secret the trainer pods read, each once, in the order the spec names them."""
        refs = [self.gcs_key_file, self.s3_credentials, *self.env]
        return list(dict.fromkeys(r.secret_name for r in refs if r is not None))


class EnvVar(ApiModel):
    """A plain (non-secret) environment variable for the trainer containers."""

    name: str = Field(pattern=ENV_NAME, max_length=128, description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Value. Never put secrets here; use secrets.env.")
