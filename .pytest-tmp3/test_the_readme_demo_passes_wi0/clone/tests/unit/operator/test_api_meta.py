"""api_meta.ObjectMeta: the run's name and namespace checked as the API server checks them (and the name within the
operator's own length limit), misspelt metadata refused, the rest of ObjectMeta kept."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainingrun_operator.api_meta import MAX_RUN_NAME_LENGTH, ObjectMeta


def test_a_name_of_the_longest_length_fits_every_child_name_in_63():
    name = "r" * MAX_RUN_NAME_LENGTH
    ObjectMeta(name=name)
    assert len(f"{name}-a9999-worker-99999") <= 63
    with pytest.raises(ValidationError, match=f"at most {MAX_RUN_NAME_LENGTH}.*choose a shorter name"):
        ObjectMeta(name=name + "r")


@pytest.mark.parametrize("name", ["Train", "1st", "run-", "run_1", "rün", "run.1", ""])
def test_names_that_cannot_prefix_a_service_are_refused(name):
    with pytest.raises(ValidationError, match="is not a valid name"):
        ObjectMeta(name=name)


@pytest.mark.parametrize("namespace", ["Team", "-a", "a" * 64, "ä", "a.b"])
def test_namespaces_must_be_dns_labels(namespace):
    with pytest.raises(ValidationError, match="cannot be a namespace"):
        ObjectMeta(name="run", namespace=namespace)


def test_misspelt_metadata_is_refused_and_the_api_servers_fields_are_kept():
    with pytest.raises(ValidationError, match="lables"):
        ObjectMeta.model_validate({"name": "run", "lables": {"a": "b"}})
    meta = ObjectMeta.model_validate(
        {"name": "run", "resourceVersion": "42", "ownerReferences": [{"uid": "u"}], "generateName": "run-"}
    )
    assert (meta.namespace, meta.resource_version, meta.owner_references, meta.generate_name) == (
        "default",
        "42",
        [{"uid": "u"}],
        "run-",
    )
