"""model_base: every API model is camelCase on the wire and strict as the API server (no "2" for 2, no NaN, no unknown
field), and a URI holding credentials is refused with a message that never repeats it."""

from __future__ import annotations

import re

import pytest
from pydantic import Field, ValidationError, field_validator

from trainingrun_api.model_base import CREDENTIALS_IN_URI, NO_CREDENTIALS, ApiModel, refuse_credentials


class Sample(ApiModel):
    max_steps: int = 1
    learning_rate: float = Field(default=0.1)
    uri: str = ""

    @field_validator("uri", mode="before")
    @classmethod
    def _no_credentials(cls, value):
        return refuse_credentials(value, NO_CREDENTIALS)


def test_the_wire_is_camel_case_only_and_python_snake_case():
    assert Sample.from_wire({"maxSteps": 3}).max_steps == 3
    assert Sample(max_steps=4).to_wire() == {"maxSteps": 4, "learningRate": 0.1, "uri": ""}
    with pytest.raises(ValidationError, match="max_steps"):
        Sample.from_wire({"max_steps": 3})


@pytest.mark.parametrize(
    "wire",
    [{"maxSteps": "2"}, {"maxSteps": 2.0}, {"learningRate": float("nan")}, {"learningRate": float("inf")}, {"x": 1}],
)
def test_what_the_api_server_refuses_is_refused(wire):
    with pytest.raises(ValidationError):
        Sample.from_wire(wire)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIA:secret@bucket/x",
        "https://host/path?token=abc",
        "https://host/path?a=1&X-Amz-Signature=ff",
        "gs://bucket/x#access_token=abc",
        "https://host/p?SIG=1",
    ],
)
def test_a_uri_holding_credentials_is_refused_without_repeating_it(uri):
    with pytest.raises(ValidationError) as raised:
        Sample(uri=uri)
    (error,) = raised.value.errors()
    assert "spec.secrets" in error["msg"] and uri not in error["msg"]  # problems.py words errors from "msg" alone


@pytest.mark.parametrize(
    "uri", ["s3://bucket/runs/demo", "gs://bucket/x?generation=3", "https://host/path?page=2#top", "file:///tmp/a@b"]
)
def test_plain_uris_pass(uri):
    assert Sample(uri=uri).uri == uri
    assert not re.match(CREDENTIALS_IN_URI, uri)
