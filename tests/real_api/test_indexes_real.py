"""indexes.py against a real API server: what the operator keeps of a job it created has the view the watch shows.

The server fills in what a CRD's schema defaults and what it assigns itself; a difference in anything the operator
keeps (indexes.slim_job) would make every created job's first event look changed, and reconciled again for nothing.
"""

import json

from trainingrun_operator import pytorchjob, validation
from trainingrun_operator.backends import PYTORCHJOB
from trainingrun_operator.indexes import job_view, slim_job
from trainingrun_operator.settings import Settings


def test_the_server_shows_the_created_job_with_the_view_it_was_sent_with(kube_cluster_with_crds, kube_namespace):
    plane, namespace = kube_cluster_with_crds, kube_namespace
    run = {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": {"checkpoint": {"uri": "s3://bucket/demo"}, "replicas": {"min": 1, "max": 2}},
    }
    created = json.loads(plane.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(run)).stdout)
    sent = pytorchjob.pytorch_job(validation.parse(created, from_server=True), 1, Settings(signing_key=b"k" * 32))
    shown = json.loads(plane.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(sent)).stdout)
    assert shown["metadata"]["uid"] and shown["metadata"]["creationTimestamp"]  # what the server assigned
    assert job_view(slim_job(shown, PYTORCHJOB)) == job_view(slim_job(sent, PYTORCHJOB))
    shown = json.loads(
        plane.kubectl(
            "-n", namespace, "label", "-o", "json", "pytorchjobs.kubeflow.org", sent["metadata"]["name"], "team=a"
        ).stdout
    )
    assert job_view(slim_job(shown, PYTORCHJOB)) != job_view(slim_job(sent, PYTORCHJOB))
