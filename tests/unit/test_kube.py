"""API paths for the kinds the operator writes."""
from trainingrun_operator.kube import collection_path, object_path


def test_paths():
    assert collection_path("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    assert collection_path("kubeflow.org/v1", "PyTorchJob", "ns") == "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs"
    assert object_path("trainingrun.dev/v1alpha1", "TrainingRun", "ns", "demo", "status") == \
        "/apis/trainingrun.dev/v1alpha1/namespaces/ns/trainingruns/demo/status"
    assert object_path("rbac.authorization.k8s.io/v1", "Role", "ns", "r") == \
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r"
