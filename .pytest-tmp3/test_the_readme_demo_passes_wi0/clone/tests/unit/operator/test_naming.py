"""naming: what the operator's children are called and carry, the same for the same run (a restarted operator finds
what it made), owned by the run (deleting it deletes them), and a signature only the operator's key makes, bound to
one job."""

from __future__ import annotations

import copy

from trainingrun_operator import api_meta, naming, validation


def run_of(body, **spec):
    body["spec"].update(spec)
    return validation.parse(body)


def test_every_child_name_of_the_longest_run_fits_a_service_name(minimal_body):
    name = "r" * api_meta.MAX_RUN_NAME_LENGTH
    assert naming.job_name(name, 9999) == f"{name}-a9999"
    assert len(naming.worker_pod(name, 9999, 99999)) <= 63
    assert naming.rendezvous_host_pod(name, 3) == naming.worker_pod(name, 3, 0)


def test_the_signature_needs_the_key_and_binds_run_name_and_job_uid():
    signed = naming.job_signature(b"key", "run-uid", "demo-a1", "job-uid")
    assert signed.startswith("v2.") and len(signed) == 3 + 32
    assert signed == naming.job_signature(b"key", "run-uid", "demo-a1", "job-uid")
    others = [
        naming.job_signature(b"other", "run-uid", "demo-a1", "job-uid"),
        naming.job_signature(b"key", "run-uid2", "demo-a1", "job-uid"),
        naming.job_signature(b"key", "run-uid", "demo-a2", "job-uid"),
        naming.job_signature(b"key", "run-uid", "demo-a1", "planted-job"),
    ]
    assert signed not in others


def test_the_spec_digest_ignores_suspend_and_sees_any_other_change(minimal_body):
    base = naming.spec_digest(run_of(copy.deepcopy(minimal_body)))
    assert naming.spec_digest(run_of(copy.deepcopy(minimal_body), suspend=True)) == base
    assert naming.spec_digest(run_of(copy.deepcopy(minimal_body), trainer={"maxSteps": 7})) != base
    # the digest older operators wrote is another function of the same spec, still stable
    assert naming.legacy_spec_hash(run_of(copy.deepcopy(minimal_body))) == naming.legacy_spec_hash(
        run_of(copy.deepcopy(minimal_body), suspend=True)
    )


def test_children_are_labelled_and_owned_by_the_run(minimal_body):
    run = run_of(minimal_body)
    meta = naming.metadata(run, "demo-a1", "trainer", extra="x")
    assert meta["namespace"] == "team-a"
    assert meta["labels"][naming.LABEL_RUN] == "demo" and meta["labels"]["extra"] == "x"
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == minimal_body["metadata"]["uid"]
    assert owner["controller"] is True and owner["blockOwnerDeletion"] is True


def test_only_a_run_of_several_pods_gets_a_rendezvous_service(minimal_body):
    assert not naming.has_rendezvous_service(run_of(copy.deepcopy(minimal_body)).spec)
    assert naming.has_rendezvous_service(run_of(copy.deepcopy(minimal_body), replicas={"min": 1, "max": 2}).spec)
