"""api_env: credentials only by reference, with the Secret names and keys the API server would take, and each Secret
the pods read named once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainingrun_operator.api_env import EnvVar, S3Credentials, SecretEnv, SecretKeyRef, Secrets


@pytest.mark.parametrize("key", ["key.json", "AWS_ACCESS_KEY_ID", "a-b_c.d", ".dotfile", "x"])
def test_secret_keys_the_api_server_takes(key):
    assert SecretKeyRef(secret_name="gcs", key=key).key == key


@pytest.mark.parametrize("key", ["", ".", "..", "..hidden", "a/b", "a b", "é", "k" * 254])
def test_secret_keys_it_refuses(key):
    with pytest.raises(ValidationError) as raised:
        SecretKeyRef(secret_name="gcs", key=key)
    assert raised.value.errors()[0]["loc"] == ("key",)


@pytest.mark.parametrize("name", ["Upper", "-lead", "a_b", "a" * 254, "trail-"])
def test_a_secret_name_must_be_a_dns_subdomain(name):
    with pytest.raises(ValidationError):
        SecretEnv(name="WANDB_API_KEY", secret_name=name, key="k")


@pytest.mark.parametrize("name", ["1ST", "A-B", "", "A B", "Ä"])
def test_variable_names_are_c_identifiers(name):
    with pytest.raises(ValidationError):
        EnvVar(name=name, value="x")


def test_s3_credentials_default_to_the_aws_key_names_and_take_camel_case():
    creds = S3Credentials.model_validate({"secretName": "s3"})
    assert (creds.access_key_id_key, creds.secret_access_key_key, creds.session_token_key) == (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        None,
    )
    with pytest.raises(ValidationError, match="accessKey"):
        S3Credentials.model_validate({"secretName": "s3", "accessKey": "AKIA..."})  # a value is no field here


def test_secret_names_lists_each_secret_once_in_spec_order():
    secrets = Secrets.model_validate(
        {
            "gcsKeyFile": {"secretName": "gcs", "key": "key.json"},
            "s3Credentials": {"secretName": "shared"},
            "env": [
                {"name": "WANDB_API_KEY", "secretName": "trackers", "key": "wandb"},
                {"name": "HF_TOKEN", "secretName": "shared", "key": "hf"},
            ],
        }
    )
    assert secrets.secret_names() == ["gcs", "shared", "trackers"]
    assert Secrets().secret_names() == []


def test_more_than_64_secret_variables_are_refused():
    env = [{"name": f"V{i}", "secretName": "s", "key": "k"} for i in range(65)]
    with pytest.raises(ValidationError, match="at most 64"):
        Secrets.model_validate({"env": env})
