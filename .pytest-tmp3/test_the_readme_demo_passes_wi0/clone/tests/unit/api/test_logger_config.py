"""logger_config.LoggerConfig: each kind of tracker with the one field it needs and no field of another kind;
credentials in a tracker's URI refused in a message that does not repeat them (that the whole error never shows the
value: tests/security)."""

import pydantic
import pytest

from trainingrun_api.logger_config import LOGGER_FIELD_KINDS, LOGGER_NEEDS, LoggerConfig

WITH_ITS_FIELD = {
    "tensorboard": {"kind": "tensorboard", "logDir": "s3://bucket/tb/demo"},
    "mlflow": {"kind": "mlflow", "trackingUri": "http://mlflow.mlflow:5000"},
    "wandb": {"kind": "wandb", "project": "demo"},
}


@pytest.mark.parametrize("kind, field, wire, what", LOGGER_NEEDS)
def test_each_kind_needs_its_field_and_says_what_it_is(kind, field, wire, what):
    assert getattr(LoggerConfig.model_validate(WITH_ITS_FIELD[kind]), field)
    with pytest.raises(pydantic.ValidationError, match=f"a {kind} logger needs {wire}: {what}"):
        LoggerConfig.model_validate({"kind": kind})


@pytest.mark.parametrize("field, wire, kinds", LOGGER_FIELD_KINDS)
def test_a_field_of_another_kind_is_refused_naming_the_kinds_it_is_for(field, wire, kinds):
    for kind, document in WITH_ITS_FIELD.items():
        given = {**document, wire: "x"}
        if kind in kinds:
            assert getattr(LoggerConfig.model_validate(given), field) == "x"
        else:
            with pytest.raises(pydantic.ValidationError, match=f"{wire} is for {' and '.join(kinds)} loggers only"):
                LoggerConfig.model_validate(given)


@pytest.mark.parametrize(
    "kind, wire, uri",
    [
        ("mlflow", "trackingUri", "https://alice:hunter2@mlflow.example.com"),
        ("mlflow", "trackingUri", "https://mlflow.example.com/?token=hunter2"),
        ("tensorboard", "logDir", "s3://bucket/tb?X-Amz-Signature=hunter2"),
    ],
)
def test_credentials_in_a_trackers_uri_are_refused_and_never_repeated(kind, wire, uri):
    with pytest.raises(pydantic.ValidationError) as refused:
        LoggerConfig.model_validate({**WITH_ITS_FIELD[kind], wire: uri})
    (message,) = [error["msg"] for error in refused.value.errors()]  # what `trainingrun validate` shows
    assert "holds credentials" in message and "spec.secrets.env" in message and "hunter2" not in message


def test_the_crd_rules_say_the_same_as_the_model():
    rules = LoggerConfig.model_json_schema()["x-kubernetes-validations"]
    messages = {rule["message"] for rule in rules}
    for kind, _, wire, what in LOGGER_NEEDS:
        assert f"a {kind} logger needs {wire}: {what}" in messages
    for _, wire, kinds in LOGGER_FIELD_KINDS:
        assert f"{wire} is for {' and '.join(kinds)} loggers only; remove it" in messages
