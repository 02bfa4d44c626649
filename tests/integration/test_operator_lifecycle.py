"""The operator for real against kmock: lifecycle, recovery, budgets, stalls, secrets, suspend, spec changes."""

import asyncio
import json
from datetime import datetime, timedelta

import pytest

from operator_harness import (
    NAMESPACE,
    PODS,
    RUNS,
    Cluster,
    declare_resources,
    eventually,
    operator,
    running,
    terminated,
    training_run,
)
from trainingrun_operator import naming

pytestmark = pytest.mark.asyncio


@pytest.fixture
def cluster(kmock):
    declare_resources(kmock)
    return Cluster(kmock)


async def test_full_lifecycle_create_running_succeeded(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"), what="attempt 1's PyTorchJob")
        # status is written once the job exists (the config rides in its pods' annotations: no ConfigMap)
        status = await eventually(lambda: cluster.status().get("phase") == "Pending" and cluster.status())
        assert status["attempt"] == 1 and status["jobName"] == "demo-a1"
        assert cluster.job("demo-a1")["metadata"]["ownerReferences"][0]["uid"] == "0000-demo"
        assert cluster.obj("v1/configmaps", "demo-config") is None

        await cluster.add_pod("demo-a1", status=running())
        await cluster.job_condition("demo-a1", "Created", "Running")
        await eventually(lambda: cluster.status().get("phase") == "Running", what="phase Running")

        await cluster.job_condition("demo-a1", "Created", "Succeeded")
        status = await eventually(lambda: cluster.status().get("phase") == "Succeeded" and cluster.status())
        assert status["completionTime"]
        # Events are posted right after the status they explain: wait for the last one, then compare all
        await eventually(lambda: cluster.events("Succeeded"), what="the Succeeded Event")
        assert [e["reason"] for e in cluster.events()] == ["AttemptStarted", "Running", "Succeeded"]


async def fail_attempt(cluster, job_name, exit_code=137, reason="OOMKilled", **pod_metadata):
    pod = await cluster.add_pod(job_name, status=running())
    await cluster.pod_status(pod, terminated(exit_code, reason), **pod_metadata)
    await cluster.job_condition(job_name, "Created", "Failed", message="worker failed")
    return pod


async def test_failure_recovers_into_attempt_2_resuming_from_the_last_good_checkpoint(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        checkpoint = {"uri": "s3://bucket/demo/step-00000300", "step": 300, "time": "2026-11-21T00:00:00Z"}
        await cluster.progress("demo", 310, "2026-11-21T00:00:05Z", checkpoint=checkpoint)
        await fail_attempt(cluster, "demo-a1")
        await eventually(lambda: cluster.job("demo-a2"), what="attempt 2")
        assert cluster.env_of("demo-a2")["TRAININGRUN_RESUME_FROM"] == "s3://bucket/demo/step-00000300"
        assert "TRAININGRUN_RESUME_FROM" not in cluster.env_of("demo-a1")
        status = await eventually(lambda: cluster.status().get("attempt") == 2 and cluster.status())
        assert status["phase"] == "Pending" and status["jobName"] == "demo-a2"
        assert status["restarts"] == {"failures": 1, "preemptions": 0, "total": 1, "backoffSeconds": 0.0}
        failed = await eventually(lambda: cluster.events("AttemptFailed"))
        assert len(failed) == 1 and "exited with 137 (OOMKilled)" in failed[0]["message"]
        # the Event is posted just after the status it explains: wait for it rather than read it at once
        await eventually(
            lambda: any(
                "resuming from s3://bucket/demo/step-00000300" in e["message"] for e in cluster.events("AttemptStarted")
            ),
            what="attempt 2's Event",
        )
        assert cluster.job_names() == ["demo-a1", "demo-a2"]  # the failed attempt stays for its logs


async def test_recovering_waits_for_the_backoff(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(recovery={"backoffSeconds": 2}))
        await eventually(lambda: cluster.job("demo-a1"))
        await fail_attempt(cluster, "demo-a1")
        status = await eventually(lambda: cluster.status().get("phase") == "Recovering" and cluster.status())
        assert status["nextAttemptTime"] > status["attemptStartTime"]
        assert cluster.job("demo-a2") is None  # not before the backoff ends
        await eventually(lambda: cluster.job("demo-a2"), timeout=10, what="attempt 2 after the backoff")
        await eventually(lambda: cluster.status()["attempt"] == 2 and "nextAttemptTime" not in cluster.status())


async def test_preemption_is_charged_to_its_own_budget(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(recovery={"backoffSeconds": 0, "maxPreemptions": 5, "maxFailures": 0}))
        await eventually(lambda: cluster.job("demo-a1"))
        pod = await cluster.add_pod("demo-a1", status=running())
        disrupted = terminated(143, "Error")
        disrupted["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
        await cluster.pod_status(pod, disrupted)
        await cluster.job_condition("demo-a1", "Failed")
        await eventually(lambda: cluster.job("demo-a2"), what="attempt 2 after a preemption")
        status = await eventually(lambda: cluster.status().get("restarts") and cluster.status())
        assert status["restarts"] == {
            "failures": 0,
            "preemptions": 1,
            "total": 1,
            "backoffSeconds": 0.0,
        }  # maxFailures=0 is untouched
        preempted = await eventually(lambda: cluster.events("AttemptPreempted"))
        assert "PreemptionByScheduler" in preempted[0]["message"]

        # exit 143 alone (the trainer's emergency checkpoint after SIGTERM) is a preemption too
        await fail_attempt(cluster, "demo-a2", exit_code=143, reason="Error")
        await eventually(
            lambda: cluster.job("demo-a3"), what=lambda: f"attempt 3: {cluster.status()} {cluster.events()}"
        )
        assert cluster.status()["restarts"]["preemptions"] == 2


async def test_spent_budget_fails_the_run_with_a_reason(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(recovery={"backoffSeconds": 0, "maxFailures": 1}))
        await eventually(lambda: cluster.job("demo-a1"))
        await fail_attempt(cluster, "demo-a1")
        await eventually(lambda: cluster.job("demo-a2"))
        await fail_attempt(cluster, "demo-a2")
        status = await eventually(lambda: cluster.status().get("phase") == "Failed" and cluster.status())
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "FailureBudgetSpent"
        assert "spec.recovery.maxFailures=1 is spent" in failed["message"]
        assert cluster.job("demo-a3") is None
        await eventually(lambda: cluster.events("FailureBudgetSpent"))
        # the run ended: only the final attempt is kept
        await eventually(lambda: cluster.job_names() == ["demo-a2"], what="attempt 1 to be cleaned up")


async def test_permanent_exit_fails_at_once_with_the_trainers_message(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        pod = await cluster.add_pod("demo-a1", status=running())
        await cluster.pod_status(pod, terminated(2, "Error", "spec.trainer.model.classPath: no class NoSuchModel"))
        await cluster.job_condition("demo-a1", "Failed")
        status = await eventually(lambda: cluster.status().get("phase") == "Failed" and cluster.status())
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "PermanentError"
        assert "exited with 2: spec.trainer.model.classPath: no class NoSuchModel" in failed["message"]
        assert "restarts" not in status and cluster.job("demo-a2") is None


async def test_stalled_attempt_is_restarted_and_charged_as_a_failure(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(recovery={"backoffSeconds": 0, "stallTimeoutSeconds": 1}))
        started = await eventually(lambda: cluster.job("demo-a1") and cluster.status().get("attemptStartTime"))
        started = datetime.fromisoformat(started.replace("Z", "+00:00"))
        reported = (started + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        await cluster.progress("demo", 42, reported, productive_seconds=0.5)
        # goodput is computed from that report: the operator has seen it before the attempt runs
        await eventually(lambda: "goodput" in cluster.status(), what="the operator to see step 42")
        await cluster.add_pod("demo-a1", status=running())
        await cluster.job_condition("demo-a1", "Created", "Running")

        async def heartbeats():  # rank 0 keeps reporting the same step, as a stuck trainer's reporter thread does
            while not cluster.job("demo-a2"):
                await cluster.progress("demo", 42, reported, productive_seconds=0.5)
                await asyncio.sleep(0.2)  # the reporter's interval, scaled down with stallTimeoutSeconds

        beating = asyncio.create_task(heartbeats())
        await eventually(lambda: cluster.job("demo-a2"), timeout=10, what="a restart after the stall")
        await beating
        stalled = await eventually(lambda: cluster.events("Stalled"))
        assert len(stalled) == 1 and "last step 42" in stalled[0]["message"]
        assert cluster.status()["restarts"]["failures"] == 1
        assert cluster.job("demo-a1") is None  # the stuck attempt's job is deleted so its pods stop


async def test_missing_secret_sets_a_condition_without_spending_budget(kmock, cluster):
    async with operator(kmock):
        body = training_run(secrets={"env": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": "api-key"}]})
        await cluster.create_run(body)
        await eventually(lambda: cluster.job("demo-a1"))
        waiting = {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "pytorch",
                    "state": {
                        "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "wandb" not found'}
                    },
                }
            ],
        }
        pod = await cluster.add_pod("demo-a1", status=waiting)
        condition = await eventually(
            lambda: next(c for c in cluster.status()["conditions"] if c["type"] == "SecretMissing")
        )
        assert condition["status"] == "True" and 'secret "wandb" not found' in condition["message"]
        await eventually(lambda: cluster.events("SecretMissing"))
        assert "restarts" not in cluster.status() and cluster.status()["phase"] == "Pending"

        await cluster.pod_status(pod, running())
        await cluster.job_condition("demo-a1", "Created", "Running")
        await eventually(lambda: cluster.status()["phase"] == "Running")
        condition = next(c for c in cluster.status()["conditions"] if c["type"] == "SecretMissing")
        assert condition["status"] == "False" and condition["reason"] == "SecretsFound"


async def test_suspend_and_resume_from_the_last_good_checkpoint(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        await cluster.job_condition("demo-a1", "Created", "Running")
        await eventually(lambda: cluster.status()["phase"] == "Running")
        await cluster.progress(
            "demo", 500, "2026-11-21T00:00:05Z", checkpoint={"uri": "s3://bucket/demo/step-00000500", "step": 500}
        )
        worker = await cluster.add_pod("demo-a1", status={"phase": "Running"})
        await cluster.patch(RUNS, "demo", {"spec": {"suspend": True}})
        await eventually(lambda: cluster.job("demo-a1")["spec"]["runPolicy"]["suspend"] is True)
        await eventually(lambda: cluster.status()["phase"] == "Suspended")
        await eventually(lambda: cluster.events("Suspended"))

        # Resumed while the suspended attempt's pod still writes its emergency checkpoint: attempt 2 waits for it.
        await cluster.patch(RUNS, "demo", {"spec": {"suspend": False}})
        await eventually(
            lambda: any(
                c["type"] == "WaitingForOldPods" and c["status"] == "True"
                for c in cluster.status().get("conditions") or []
            ),
            what="waiting for old pods",
        )
        assert cluster.job("demo-a2") is None
        await cluster.delete(PODS, worker)
        await eventually(lambda: cluster.job("demo-a2"), what="a new attempt on resume")
        assert cluster.env_of("demo-a2")["TRAININGRUN_RESUME_FROM"] == "s3://bucket/demo/step-00000500"
        assert cluster.job("demo-a2")["spec"]["runPolicy"]["suspend"] is False
        status = await eventually(lambda: cluster.status()["attempt"] == 2 and cluster.status())
        assert status["phase"] == "Pending" and "restarts" not in status  # suspending costs no budget


async def test_a_suspend_whose_job_is_gone_leaves_the_run_suspended(kmock, cluster):
    """Suspending reaches a job the operator has not seen yet (reconcile.py); when there is no such job after all
    (removed by someone; kmock answers the suspend's patch with 404, as a server does for a job that is not there),
    nothing of it runs: the run is Suspended, not retried forever."""
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        await eventually(lambda: cluster.status().get("phase") == "Pending")
        kmock[f"patch /apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs/demo-a1"] << 404
        await cluster.patch(RUNS, "demo", {"spec": {"suspend": True}})
        await eventually(lambda: cluster.status().get("phase") == "Suspended", what=lambda: cluster.status())
        await eventually(lambda: cluster.events("Suspended"))


async def test_spec_change_applies_from_the_next_attempt(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(image="registry.example/trainer:1"))
        await eventually(lambda: cluster.job("demo-a1"))
        await cluster.patch(RUNS, "demo", {"spec": {"image": "registry.example/trainer:2"}})
        condition = await eventually(
            lambda: next(c for c in cluster.status()["conditions"] if c["type"] == "SpecChangePending")
        )
        assert condition["status"] == "True" and "applies from attempt 2" in condition["message"]

        def image(job):
            return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"]

        assert image(cluster.job("demo-a1")) == "registry.example/trainer:1"  # the running attempt is left alone

        await fail_attempt(cluster, "demo-a1")
        await eventually(lambda: cluster.job("demo-a2"))
        assert image(cluster.job("demo-a2")) == "registry.example/trainer:2"
        condition = await eventually(
            lambda: next(
                c for c in cluster.status()["conditions"] if c["type"] == "SpecChangePending" and c["status"] == "False"
            )
        )
        assert condition["reason"] == "Applied"


async def test_checkpoint_uri_cannot_change_while_running(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        await cluster.patch(RUNS, "demo", {"spec": {"checkpoint": {"uri": "s3://elsewhere/demo"}}})
        condition = await eventually(
            lambda: next(c for c in cluster.status()["conditions"] if c["type"] == "SpecRejected")
        )
        assert condition["reason"] == "CheckpointUriImmutable" and "s3://bucket/demo" in condition["message"]
        await eventually(lambda: cluster.events("SpecRejected"))
        await fail_attempt(cluster, "demo-a1")
        await eventually(lambda: cluster.job("demo-a2"))
        template = cluster.job("demo-a2")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        config = json.loads(template["metadata"]["annotations"][naming.ANNOTATION_CONFIG])
        assert config["checkpoint"]["uri"] == "s3://bucket/demo"  # the URI the run started with, not the edit


async def test_operator_restarted_mid_recovery_makes_no_duplicate(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run(recovery={"backoffSeconds": 2}))
        await eventually(lambda: cluster.job("demo-a1"))
        await fail_attempt(cluster, "demo-a1")
        await eventually(lambda: cluster.status().get("phase") == "Recovering")
    # the operator is gone for a while; a new process (empty memory) takes over from status alone
    async with operator(kmock):
        await eventually(lambda: cluster.job("demo-a2"), timeout=10, what="attempt 2 from the new operator")
        await eventually(lambda: cluster.status().get("attempt") == 2)
    async with operator(kmock):  # and once more, with attempt 2 pending: nothing new
        await eventually(lambda: any("pytorchjobs" in str(r.url) and "watch=true" in str(r.url) for r in list(kmock)))
        status = cluster.status()
    assert cluster.job_names() == ["demo-a1", "demo-a2"]
    assert status["attempt"] == 2 and status["restarts"] == {
        "failures": 1,
        "preemptions": 0,
        "total": 1,
        "backoffSeconds": 2.0,
    }
    posts = [r for r in list(kmock) if r.method == "POST" and str(r.url).split("?")[0].endswith("/pytorchjobs")]
    assert sorted(r.data["metadata"]["name"] for r in posts) == ["demo-a1", "demo-a2"]


async def test_deleting_the_run_leaves_no_children_to_the_operator(kmock, cluster):
    async with operator(kmock):
        await cluster.create_run(training_run())
        await eventually(lambda: cluster.job("demo-a1"))
        await cluster.delete(RUNS, "demo")
        await eventually(lambda: cluster.obj(RUNS, "demo") is None, what="the run to go (kopf's finalizer removed)")
        # kmock has no garbage collector: ownerReferences make the API server delete the children.
        assert cluster.job("demo-a1")["metadata"]["ownerReferences"][0]["name"] == "demo"
        deletes = [r for r in list(kmock) if r.method == "DELETE" and "trainingruns" not in str(r.url)]
        assert deletes == []  # the operator deletes nothing itself, checkpoints least of all


async def test_a_spec_the_operator_cannot_run_is_rejected_without_children(kmock, cluster):
    async with operator(kmock):
        body = training_run()
        body["spec"]["replicas"] = {"min": 3, "max": 1}  # the API server's CEL rule would refuse it; kmock does not
        await cluster.create_run(body)
        condition = await eventually(
            lambda: next(c for c in cluster.status()["conditions"] if c["type"] == "SpecRejected")
        )
        await eventually(lambda: cluster.events("SpecRejected"))
        assert condition["reason"] == "InvalidSpec" and "spec.replicas" in condition["message"]
        assert cluster.job("demo-a1") is None
