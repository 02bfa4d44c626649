"""kube_shapes: Kubernetes' own rules for what a TrainingRun passes on to its pods (labels, annotations, tolerations,
affinity), at their boundaries. tests/real_api/test_validate_agrees.py checks the same rules agree with a real API
server; these name the boundary each rule draws."""

import pydantic
import pytest

from trainingrun_operator import kube_shapes


@pytest.mark.parametrize(
    "key",
    ["a", "app", "example.com/team", "a" * 63, f"{'d' * 253}/{'n' * 63}", "A_b.c-D", "x.y.z/Name_1"],
)
def test_qualified_names_kubernetes_takes_are_taken(key):
    assert kube_shapes.qualified_name_problem(key) is None


@pytest.mark.parametrize(
    "key",
    [
        "",
        "a" * 64,  # the name part is at most 63
        f"{'d' * 254}/n",  # the prefix at most 253
        "-a",
        "a-",
        "Example.com/x",  # the prefix is a lowercase DNS subdomain
        "a/b/c",
        "/a",
        "a b",
        "caf\u00e9",  # ASCII only
        "a\n",  # matched whole: no trailing newline
    ],
)
def test_qualified_names_kubernetes_refuses_are_refused_naming_the_key(key):
    problem = kube_shapes.qualified_name_problem(key)
    assert problem is not None and repr(key) in problem


@pytest.mark.parametrize(
    "value, ok",
    [
        ("", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("v1.2_x-y", True),
        ("-v", False),
        ("v-", False),
        ("a/b", False),
        ("\u0661", False),
    ],
)
def test_label_values_are_at_most_63_plain_characters_or_empty(value, ok):
    assert (kube_shapes.label_value_problem("k", value) is None) is ok


def test_pod_labels_refuse_the_keys_the_operators_set_and_other_maps_take_them():
    for key in ("trainingrun.dev/run", "training.kubeflow.org/job-name", "app.kubernetes.io/name"):
        with pytest.raises(ValueError, match="set by the operator"):
            kube_shapes.check_labels({key: "x"}, reserved=True)
        assert kube_shapes.check_labels({key: "x"}) == {key: "x"}
    assert kube_shapes.check_labels({"app.kubernetes.io/part-of": "x"}, reserved=True)


def test_annotations_count_keys_and_values_in_bytes_against_the_api_servers_limit():
    limit = kube_shapes.MAX_ANNOTATIONS_BYTES
    exactly = {"k": "x" * (limit - 1)}
    assert kube_shapes.annotations_bytes(exactly) == limit and kube_shapes.check_annotations(exactly)
    with pytest.raises(ValueError, match=f"total {limit + 1} bytes"):
        kube_shapes.check_annotations({"k": "x" * limit})
    assert kube_shapes.annotations_bytes({"k": "\u00e9"}) == 3  # UTF-8 bytes, not characters
    with pytest.raises(ValueError, match="not a valid Kubernetes key"):
        kube_shapes.check_annotations({"bad key": ""})


@pytest.mark.parametrize(
    "toleration, refused",
    [
        ({"key": "gpu", "operator": "Exists"}, None),
        ({"operator": "Exists"}, None),  # every taint
        ({"key": "gpu", "value": "a100", "effect": "NoSchedule"}, None),
        ({"key": "gpu", "effect": "NoExecute", "tolerationSeconds": 30}, None),
        ({"key": "gpu", "operator": "Exists", "value": "a100"}, "value must be empty when operator is Exists"),
        ({"value": "a100"}, "operator must be Exists when key is empty"),
        ({"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30}, "tolerationSeconds needs effect NoExecute"),
        ({"key": "gpu", "tolerationSeconds": 30}, "tolerationSeconds needs effect NoExecute"),
        ({"key": "bad key", "operator": "Exists"}, "not a valid Kubernetes key"),
        ({"key": "gpu", "operator": "Equal", "value": "x" * 64}, "at most 63"),
        ({"key": "gpu", "tolerationSeconds": -1, "effect": "NoExecute"}, "greater than or equal to 0"),
    ],
)
def test_tolerations_follow_core_v1s_rules(toleration, refused):
    if refused is None:
        kube_shapes.Toleration.model_validate(toleration)
        return
    with pytest.raises(pydantic.ValidationError, match=refused):
        kube_shapes.Toleration.model_validate(toleration)


@pytest.mark.parametrize(
    "operator, values, refused",
    [
        ("In", ["a", "b"], None),
        ("In", [], "needs values"),
        ("NotIn", [], "needs values"),
        ("Exists", [], None),
        ("Exists", ["a"], "takes no values"),
        ("DoesNotExist", ["a"], "takes no values"),
        ("Gt", ["8"], None),
        ("Lt", ["-3"], None),
        ("Gt", ["8", "9"], "exactly one integer"),
        ("Gt", ["eight"], "exactly one integer"),
        ("Gt", ["\u0668"], "exactly one integer"),  # an Arabic-Indic eight: int() reads it, the API server not
        ("In", ["-bad"], "not a valid label value"),
    ],
)
def test_selector_requirements_follow_core_v1s_rules(operator, values, refused):
    problem = kube_shapes.requirement_problem("k", operator, values)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem


def test_affinity_checks_every_requirement_it_nests():
    good = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu.example.com/count", "operator": "Gt", "values": ["3"]}]}
                ]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app": "train"}},
                    },
                }
            ]
        },
    }
    kube_shapes.Affinity.model_validate(good)
    deep = good["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    deep["labelSelector"]["matchExpressions"] = [{"key": "app", "operator": "In"}]
    with pytest.raises(pydantic.ValidationError, match="operator In needs values"):
        kube_shapes.Affinity.model_validate(good)
    with pytest.raises(pydantic.ValidationError, match="less than or equal to 100"):
        kube_shapes.PreferredSchedulingTerm.model_validate({"weight": 101, "preference": {}})
    with pytest.raises(pydantic.ValidationError, match="at least 1 item"):
        kube_shapes.NodeSelector.model_validate({"nodeSelectorTerms": []})


def test_avoided_nodes_are_kept_out_of_every_required_term_and_the_rest_of_the_affinity_stays():
    from trainingrun_operator.kube_shapes import avoiding

    avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-3", "gpu-9"]}
    alone = avoiding(None, ["gpu-9", "gpu-3", "gpu-9"])
    assert alone == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [avoid]}]}}}  # fmt: skip
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    users = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchFields": [zone]}]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [zone]}}
            ],
        },
        "podAntiAffinity": {"x": 1},
    }
    merged = avoiding(users, ["gpu-9", "gpu-3"])
    terms = merged["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [zone], "matchFields": [avoid]}, {"matchFields": [zone, avoid]}]  # ORed
    assert (
        merged["podAntiAffinity"] == {"x": 1}
        and merged["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    )
    assert "matchFields" not in users["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]  # fmt: skip  # the spec's own is not changed
    assert avoiding(users, []) is users
