"""The CRD is generated from the API model, committed, and a valid apiextensions/v1 object."""

import re

import kubernetes_validate
import pytest
import yaml

from trainingrun_operator import crd


@pytest.mark.parametrize("relative", crd.CRD_PATHS)
def test_committed_crd_matches_the_model(repo, relative):
    committed = (repo / relative).read_text()
    assert committed == crd.crd_yaml(), (
        f"{relative} differs from what operator/trainingrun_operator/api.py generates; run `make crd`"
    )


def test_crd_is_a_valid_apiextensions_v1_object():
    kubernetes_validate.validate(yaml.safe_load(crd.crd_yaml()), "1.30.0", strict=True)


def walk(node, path="", parent_is_properties=False):
    yield path, node
    for key in ("properties",):
        for name, child in node.get(key, {}).items():
            yield from walk(child, f"{path}.{name}" if path else name, True)
    if "items" in node:
        yield from walk(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], path + "{}")


def schema():
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural():
    """Every node has a type, or says it keeps unknown fields or is int-or-string; no $ref, anyOf or empty schemas."""
    for path, node in walk(schema()):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert (
            "type" in node or node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        ), path


def test_every_spec_and_status_field_is_documented():
    undocumented = [
        path
        for path, node in walk(schema())
        if path.startswith(("spec.", "status.")) and not path.endswith(("[]", "{}")) and not node.get("description")
    ]
    assert undocumented == []


#: What a lab result looks like in a description: a time or rate with its unit, a ratio, a machine or a benchmark.
MEASUREMENT = re.compile(
    r"\d+(\.\d+)?\s?(ms|us|GB/s|MB/s|GiB/s)\b|\d+(\.\d+)?x\b|\b(benchmark|VM|\d+-core)\b|\bon an? [A-Z]\d{3}\b|->"
)


def test_descriptions_say_what_a_field_does_not_what_was_measured():
    """`kubectl explain` shows a field's purpose, default and bounds; figures live in docs/performance.md."""
    found = [
        (path, MEASUREMENT.search(node["description"]).group(0))
        for path, node in walk(schema())
        if MEASUREMENT.search(node.get("description") or "")
    ]
    assert found == []
    assert MEASUREMENT.search("on an H100 it took 35.9 -> 31.7 ms a step")  # the rule finds what it is for


def test_api_names_and_printer_columns():
    definition = crd.crd()
    assert definition["metadata"]["name"] == "trainingruns.trainingrun.dev"
    names = definition["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("TrainingRun", "trainingruns", ["tr"])
    version = definition["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Step", "Progress", "Loss", "Restarts", "Checkpoint", "ETA", "MFU", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for column, json_path in columns.items():
        if json_path.startswith(".status."):
            node = status
            for part in json_path.split(".")[2:]:
                node = node["properties"][part]  # the column points at a field that exists
            assert node["type"] in ("string", "integer", "number"), column


def test_status_has_the_design_fields_and_no_defaults():
    status = schema()["properties"]["status"]
    assert {
        "phase",
        "attempt",
        "jobName",
        "progress",
        "lastGoodCheckpoint",
        "restarts",
        "goodput",
        "conditions",
        "observedGeneration",
    } <= set(status["properties"])
    assert set(status["properties"]["phase"]["enum"]) == {
        "Pending",
        "Running",
        "Recovering",
        "Suspended",
        "Succeeded",
        "Failed",
    }
    assert set(status["properties"]["conditions"]["items"]["properties"]) >= {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert not [p for p, n in walk(status) if "default" in n]


def test_structural_rejects_what_a_crd_cannot_express():
    with pytest.raises(ValueError, match="unions other than Optional"):
        crd.structural({"anyOf": [{"type": "string"}, {"type": "boolean"}]}, {})
    with pytest.raises(ValueError, match="without a type"):
        crd.structural({"description": "anything"}, {})


def test_a_number_or_word_becomes_int_or_string_with_a_rule_for_both():
    node = crd.structural(
        {
            "anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "const": "auto"}, {"type": "null"}],
            "default": 5,
        },
        {},
    )
    assert node["x-kubernetes-int-or-string"] and node["nullable"] and node["default"] == 5 and "type" not in node
    assert node["x-kubernetes-validations"][0]["rule"] == "type(self) == int ? self >= 1 : self in ['auto']"


def test_no_node_has_a_null_default():
    """The API server drops `default: null` from a stored CRD, so a second server-side apply of the same file by another
    field manager (helm 4 after `kubectl apply --server-side`) conflicts on .spec.versions: found by
    tests/real_api/test_install.py when an optional number-or-word (storageInterval.steps) emitted one."""
    optional_word = crd.structural(
        {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "const": "auto"}, {"type": "null"}]}, {}
    )
    assert "default" not in optional_word
    spec = yaml.safe_load(crd.crd_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert [path for path, node in walk(spec) if "default" in node and node["default"] is None] == []


def test_every_default_satisfies_its_own_rules():
    """The API server refuses a CRD whose defaults break the schema's CEL rules (it checks each default
    without filling in the defaults inside it): `recovery: {}` failed 'backoffSeconds <= maxBackoffSeconds'."""
    from crd_server import default_errors

    assert default_errors(schema()) == []


def test_the_default_check_catches_an_empty_object_default():
    from crd_server import default_errors

    broken = schema()
    broken["properties"]["spec"]["properties"]["recovery"]["default"] = {}
    errors = default_errors(broken)
    # The API server said: "no such key: backoffSeconds evaluating rule: recovery.backoffSeconds must be <= ..."
    assert any(e.startswith("spec.recovery:") and "no such member in mapping: 'backoffSeconds'" in e for e in errors), (
        errors
    )


#: Words of the lab, not of the user's cluster: figures and the machines they came from live in docs/performance.md.
LAB_WORDS = re.compile(r"\b(2-core|2 cores|VM|benchmarks?|moto|emulator|loopback|this machine|machine tried)\b", re.I)


def test_kubectl_explain_shows_users_no_lab_words():
    def descriptions(node):
        if isinstance(node, dict):
            if isinstance(node.get("description"), str):
                yield node["description"]
            for value in node.values():
                yield from descriptions(value)
        elif isinstance(node, list):
            for value in node:
                yield from descriptions(value)

    found = [d for d in descriptions(yaml.safe_load(crd.crd_yaml())) if LAB_WORDS.search(d)]
    assert found == []
