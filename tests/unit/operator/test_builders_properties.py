"""Property: any TrainingRun document either renders valid children or fails validation; never a crash.

Documents are drawn from values that are valid, borderline and wrong for each field, so both
branches are exercised. The CRD (as the API server applies it) must agree with `validate`.
"""

import kubernetes_validate
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_builders import K8S_VERSION, pytorchjob_problems

from crd_server import admit
from run_documents import documents
from trainingrun_operator import crd, pytorchjob, validation

CRD = crd.crd()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.integers(min_value=1, max_value=2001))
def test_any_document_renders_valid_children_or_fails_validation(pytorchjob_schema, body, attempt):
    _, crd_errors = admit(CRD, body)
    try:
        run = validation.parse(body)
    except validation.InvalidTrainingRun as error:
        assert error.problems and all(str(p) for p in error.problems)
        assert crd_errors, f"validate rejects but the CRD admits: {error}"
        return
    assert crd_errors == [], "the CRD rejects a document that validate accepts"
    objects = pytorchjob.children(run, attempt)
    job = next(o for o in objects if o["kind"] == "PyTorchJob")
    assert pytorchjob_problems(job, pytorchjob_schema) == []
    for obj in objects:
        if obj["kind"] != "PyTorchJob":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
        K8S_VERSION,
        strict=True,
    )
