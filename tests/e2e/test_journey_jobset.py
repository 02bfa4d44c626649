"""The same journey where only JobSet is installed (`make e2e`; marker `e2e`): a real single-node Kubernetes with the
real JobSet controller v0.9.1 and its webhooks, running in the cluster from its upstream manifests, and no Kubeflow
(tests/kube_journey.py, backend JobSet). Our chart installed with its defaults (`backend: auto`, which finds only
JobSet served), the user's 2-pod S3 run unchanged (no spec.backend), and pods lost: worker-0 (the rendezvous host)
deleted, and worker-0's every process SIGKILLed and the pod force-deleted (restored from its peer's memory). Each run
ends Succeeded with the model (digest) of an uninterrupted `trainingrun local` run, as on the PyTorchJob path
(test_journey.py, whose steps these are).

Needs what test_journey.py needs; it skips saying how to get it, except under TRAININGRUN_CI, where it must run.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from test_journey import delete_pod, lose_a_pod, lose_without_warning_and_restore_from_a_peer

import kube_journey
from kube_journey import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[Cluster]:
    kube_journey.require_the_cluster_tier()
    with kube_journey.started(tmp_path_factory.mktemp("e2e-jobset"), backend="JobSet") as cluster:
        kubeflow = cluster.kubectl("get", "crd", "pytorchjobs.kubeflow.org", check=False)
        assert kubeflow.returncode != 0, "this journey is for a cluster without Kubeflow"
        kube_journey.install_chart(cluster)
        yield cluster


def test_a_deleted_rendezvous_host_is_replaced_by_the_jobsets_job(installed, reference_digest):
    with installed.namespace("jobset-delete-worker-0") as namespace:
        lose_a_pod(installed, namespace, "delete-worker-0", 0, delete_pod, reference_digest)


def test_a_pod_lost_without_warning_restores_from_its_peers_memory_on_a_jobset(installed, reference_digest):
    lose_without_warning_and_restore_from_a_peer(installed, 0, reference_digest)
