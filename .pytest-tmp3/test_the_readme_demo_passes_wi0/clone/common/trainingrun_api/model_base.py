"""The base of every API model (`ApiModel`), the error a config raises, and the rules about credentials in URIs that
every model holding a URI follows. No torch: the operator, `trainingrun validate` and the trainer import it.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

#: Words in a query or fragment parameter's name that make its value a credential (`?token=`, `#access_token=`,
#: `X-Amz-Signature=`, `X-Goog-Credential=`, Azure's `sig=`, `?key=`, `?password=`...).
CREDENTIAL_PARAMETER_WORDS = "token|secret|passw|signature|credential|key|sig|auth"
#: A URI holding credentials: userinfo (user:password@) in its authority, or a parameter of its query or fragment
#: named like a credential. One pattern for pydantic (Python's re) and the CRD's CEL rules (RE2): both read it alike.
CREDENTIALS_IN_URI = (
    r"^[A-Za-z][-+.A-Za-z0-9]*://([^/]*@|[^?#]*[?#]([^#]*[&;#])?(?i:[^=&;#]*(" + CREDENTIAL_PARAMETER_WORDS + r")"
    r"[^=&;#]*)=)"
)
NO_CREDENTIALS = (
    "holds credentials (user:password@ before the bucket or host, or a token, key or signature in its query): remove "
    "them; give storage credentials by reference in spec.secrets (s3Credentials or gcsKeyFile)"
)
TRACKER_CREDENTIALS = (
    "holds credentials (user:password@ before the host, or a token, key or signature in its query): remove them; "
    "give a tracker's "
    "credentials by reference in spec.secrets.env (MLFLOW_TRACKING_TOKEN, WANDB_API_KEY, AWS_* for a "
    "logDir in a bucket)"
)


class ConfigError(ValueError):
    """A trainer config that cannot work; the message names the field path and the fix.

    A ValueError, so callers that already treat bad values as permanent failures (exit code 1-127)
    treat this one the same way.
    """


def refuse_credentials(value: Any, message: str) -> Any:
    """`value`, or ValueError(`message`) when it is a URI holding credentials; for "before" validators, so the field's
    pattern check, whose message would repeat the value, never sees it."""
    if isinstance(value, str) and re.match(CREDENTIALS_IN_URI, value):
        raise ValueError(message)
    return value


_Model = TypeVar("_Model", bound="ApiModel")


def kubernetes_validations(rules: list[dict[str, str]]) -> JsonDict:
    """A model's CEL rules (`rule`, `message`), as the CRD generator finds them in its JSON schema."""
    return {"x-kubernetes-validations": cast(list[JsonValue], rules)}


class ApiModel(BaseModel):
    """Base of every API model: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        # Kubernetes rejects "2" for an integer field; so do we, so `validate` agrees with the API server.
        strict=True,
        # JSON has no NaN or infinity (the API server never passes one on), but YAML does (`.nan`), and `trainingrun
        # local` reads YAML: a number field without bounds would take one, and the config written for the trainer
        # (orjson: NaN is null) would then not parse.
        allow_inf_nan=False,
    )

    @classmethod
    def from_wire(cls: type[_Model], data: Any) -> _Model:
        """Parse YAML/JSON data: camelCase names only, as the CRD accepts (snake_case is for Python)."""
        return cls.model_validate(data, by_alias=True, by_name=False)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict form used in YAML, CRDs and the mounted config."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
