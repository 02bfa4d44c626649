"""reconcile.decide and what it reads (children.py, run_status.py): the operator's decisions without a cluster."""

import functools
import json
from datetime import datetime, timedelta, timezone

import pytest

from trainingrun_api import progress_report
from trainingrun_operator import api, api_status, jobset, naming, pytorchjob, reconcile, run_status, validation
from trainingrun_operator.indexes import merged_status

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=timezone.utc)


def run_of(**spec):
    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u"},
        "spec": {"checkpoint": {"uri": "s3://bkt/demo"}, **spec},
    }
    return validation.parse(body)


def job(attempt, *conditions, run=None, since=NOW):
    built = pytorchjob.pytorch_job(run or run_of(), attempt)
    built["status"] = {
        "conditions": [
            {"type": c, "status": "True", "lastTransitionTime": reconcile.rfc3339(since)} for c in conditions
        ]
    }
    return built


def pod(attempt, status, **metadata):
    return {
        "metadata": {"name": f"demo-a{attempt}-worker-0", "labels": {naming.LABEL_ATTEMPT: str(attempt)}, **metadata},
        "status": status,
    }


def ended(code, reason="Error", message="", key="state"):
    return {
        "containerStatuses": [
            {"name": "pytorch", key: {"terminated": {"exitCode": code, "reason": reason, "message": message}}}
        ]
    }


def observe(run=None, status=None, jobs=(), pods=(), now=NOW):
    return reconcile.Observed(
        run=run or run_of(),
        status=status or {},
        jobs={j["metadata"]["name"]: j for j in jobs},
        pods=list(pods),
        now=now,
    )


def running_status(attempt=1, **extra):
    return {
        "phase": "Running",
        "attempt": attempt,
        "jobName": f"demo-a{attempt}",
        "startTime": "2026-11-21T11:00:00Z",
        "attemptStartTime": "2026-11-21T11:59:00Z",
        "checkpointUri": "s3://bkt/demo",
        **extra,
    }


def test_goodput_is_a_function_of_status():
    status = {
        "startTime": "2026-11-21T11:00:00Z",
        "progress": {"productiveSeconds": 1800.0, "updatedAt": "2026-11-21T12:00:00Z"},
    }
    assert run_status.goodput(status) == 0.5
    assert run_status.goodput({"startTime": "2026-11-21T11:00:00Z"}) is None


def test_conditions_keep_their_transition_time_until_the_status_flips():
    conditions = run_status.Conditions([], "t1", 3)
    assert conditions.set("SecretMissing", True, "CreateContainerConfigError", "m")
    later = run_status.Conditions(conditions.as_list(), "t2", 3)
    assert not later.set("SecretMissing", True, "CreateContainerConfigError", "m2")
    assert later.items["SecretMissing"]["lastTransitionTime"] == "t1"
    assert later.set("SecretMissing", False, "SecretsFound")
    assert later.items["SecretMissing"]["lastTransitionTime"] == "t2"
    assert not run_status.Conditions([], "t", None).set("Never", False, "x")  # no False entry for a new type


# ---------------------------------------------------------------- decisions


def test_a_new_run_starts_attempt_one():
    plan = reconcile.decide(observe())
    assert plan.start_attempt == 1 and plan.resume_from is None and plan.attempt_cause == "initial"
    assert plan.status["phase"] == "Pending" and plan.status["jobName"] == "demo-a1"
    assert plan.status["checkpointUri"] == "s3://bkt/demo" and plan.status["startTime"] == "2026-11-21T12:00:00Z"


def test_a_run_created_suspended_creates_a_suspended_job():
    run = run_of(suspend=True)
    plan = reconcile.decide(observe(run))
    assert plan.status["phase"] == "Suspended" and plan.start_attempt == 1
    assert pytorchjob.pytorch_job(run, 1)["spec"]["runPolicy"]["suspend"] is True


def test_failed_job_without_the_pods_story_waits_then_counts_as_a_failure():
    status = running_status()
    failed = job(1, "Failed", since=NOW)
    assert reconcile.decide(observe(status=status, jobs=[failed])).status == {}
    later = NOW + reconcile.FAILURE_EVIDENCE_GRACE + timedelta(seconds=1)
    plan = reconcile.decide(observe(status=status, jobs=[failed], now=later))
    assert plan.status["phase"] == "Recovering" and plan.status["restarts"]["failures"] == 1
    delay = (reconcile.parse_time(plan.status["nextAttemptTime"]) - later).total_seconds()
    assert delay > 0 and plan.status["restarts"]["backoffSeconds"] == delay  # the backoff, kept for the breakdown


def test_the_time_account_adds_a_process_that_ended_and_breaks_wall_time_down():
    start = {"startTime": "2026-11-21T11:00:00Z", "restarts": {"backoffSeconds": 5.0}}
    first = progress_report.ProcessTime("pod/1/1", 20.0, 4.0, 0.0, 1.0, 0.5, 12.0, 0.0, 0.0)
    at = reconcile.parse_time("2026-11-21T11:00:30Z")
    status = {**start, **run_status.account_time(start, first, 11.0, at)}
    assert status["processTime"] == {"ended": None, "current": first.to_wire()}
    again = progress_report.ProcessTime("pod/1/1", 25.0, 4.0, 0.0, 1.0, 0.5, 16.0, 0.0, 0.0)  # the same process, later
    status = {**start, **run_status.account_time(status, again, 15.0, at + timedelta(seconds=5))}
    assert status["processTime"]["ended"] is None
    second = progress_report.ProcessTime("pod/2/9", 10.0, 3.0, 0.5, 0.5, 0.25, 5.0, 1.0, 13.0)  # a restart, from 13 s
    status = {**start, **run_status.account_time(status, second, 18.0, at + timedelta(seconds=30))}
    assert status["processTime"]["ended"] == {**again.to_wire(), "process": "ended"}
    breakdown = status["timeBreakdown"]
    assert breakdown["wallSeconds"] == 60.0 and sum(
        v for k, v in breakdown.items() if k != "wallSeconds"
    ) == pytest.approx(60.0)
    assert (breakdown["productiveSeconds"], breakdown["lostSeconds"], breakdown["backoffSeconds"]) == (18.0, 3.0, 5.0)
    assert breakdown["startupSeconds"] == 7.0 + (60.0 - 5.0 - 35.0)  # in processes, and when none reported
    assert api_status.TrainingRunStatus.from_wire(status).time_breakdown.eval_seconds == 1.0  # the status model has it


def test_budget_spent_fails_the_run():
    run = run_of(recovery={"maxFailures": 1, "backoffSeconds": 0})
    status = running_status(2, restarts={"failures": 1, "preemptions": 0, "total": 1})
    plan = reconcile.decide(
        observe(run, status, [job(1, "Failed"), job(2, "Failed")], [pod(2, ended(137, "OOMKilled"))])
    )
    assert plan.status["phase"] == "Failed" and plan.status["restarts"]["failures"] == 2
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "FailureBudgetSpent" and "maxFailures=1" in failed["message"]
    assert plan.start_attempt is None


def test_recovering_waits_until_the_next_attempt_time():
    status = running_status(
        phase="Recovering",
        nextAttemptTime="2026-11-21T12:00:30Z",
        lastGoodCheckpoint={"uri": "s3://bkt/demo/step-00000100", "step": 100},
        checkpointInMemory={"step": 120, "time": "2026-11-21T12:00:00Z"},
    )
    assert reconcile.decide(observe(status=status, jobs=[job(1, "Failed")])).start_attempt is None
    plan = reconcile.decide(observe(status=status, jobs=[job(1, "Failed")], now=NOW + timedelta(seconds=30)))
    assert plan.start_attempt == 2 and plan.resume_from == "s3://bkt/demo/step-00000100"
    assert plan.status["nextAttemptTime"] is None  # a merge patch removes it
    assert plan.status["checkpointInMemory"] is None  # the new attempt's pod starts with empty memory


def test_pods_short_of_memory_are_named_in_a_condition_with_the_fix_until_a_checkpoint_fits_again():
    short = running_status(checkpointMemoryShort={"pods": ["demo-a1-worker-1"], "step": 40})
    plan = reconcile.decide(observe(status=short, jobs=[job(1, "Running")]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "CheckpointMemoryShort")
    assert condition["status"] == "True" and condition["reason"] == "SharedMemoryTooSmall"
    assert "demo-a1-worker-1" in condition["message"] and "spec.resources.sharedMemory" in condition["message"]
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["CheckpointMemoryShort"]
    fits = running_status(checkpointMemoryShort={"pods": [], "step": 50}, conditions=plan.status["conditions"])
    plan = reconcile.decide(observe(status=fits, jobs=[job(1, "Running")]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "CheckpointMemoryShort")
    assert condition["status"] == "False" and "step 50 fits" in condition["message"]
    never = reconcile.decide(observe(status=running_status(), jobs=[job(1, "Running")]))
    assert not any(c["type"] == "CheckpointMemoryShort" for c in never.status.get("conditions", []))


def test_a_diagnosed_hang_is_a_condition_and_one_event_until_the_run_trains_past_it():
    hang = {
        "step": 40,
        "time": "2026-11-21T12:00:00Z",
        "diagnosis": "hang after step 40: no progress for 31 s; all_reduce #125 of process group 0 waited for rank 1",
        "ranks": [1],
    }
    hung = running_status(lastHang=hang, progress={"step": 40, "updatedAt": "2026-11-21T11:59:29Z"})
    plan = reconcile.decide(observe(status=hung, jobs=[job(1, "Running")]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "Hung")
    assert condition["status"] == "True" and condition["reason"] == "NoProgress"
    assert "waited for rank 1" in condition["message"] and "2026-11-21T12:00:00Z" in condition["message"]
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["Hung"]
    again = running_status(lastHang=hang, progress={"step": 30}, conditions=plan.status["conditions"])
    plan = reconcile.decide(observe(status=again, jobs=[job(1, "Running")]))  # resumed below it: still hung, no Event
    assert [e.reason for e in plan.events if e.type == "Warning"] == []
    past = running_status(
        lastHang=hang, progress={"step": 41}, conditions=plan.status.get("conditions") or again["conditions"]
    )
    plan = reconcile.decide(observe(status=past, jobs=[job(1, "Running")]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "Hung")
    assert condition["status"] == "False" and condition["reason"] == "TrainingAgain"
    never = reconcile.decide(observe(status=running_status(), jobs=[job(1, "Running")]))
    assert not any(c["type"] == "Hung" for c in never.status.get("conditions", []))


def test_a_named_straggler_is_a_condition_with_one_event_until_rank_0_says_none_is():
    slow = {"rank": 3, "pod": "demo-a1-worker-1", "node": "gpu-7", "ratio": 2.5, "seconds": 0.5, "medianSeconds": 0.2,
            "factor": 1.5, "step": 120}  # fmt: skip
    plan = reconcile.decide(observe(status=running_status(slowRank=slow), jobs=[job(1, "Running")]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "SlowRank")
    assert condition["status"] == "True" and condition["reason"] == "SlowerThanOthers"
    assert "rank 3 (pod demo-a1-worker-1, node gpu-7) takes 2.5x" in condition["message"]
    assert "since step 120" in condition["message"]
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["SlowRank"]
    again = running_status(slowRank=slow, conditions=plan.status["conditions"])
    plan = reconcile.decide(observe(status=again, jobs=[job(1, "Running")]))
    assert [e.reason for e in plan.events if e.type == "Warning"] == []  # still named: no second Event
    none = {"ratio": 1.1, "seconds": 0.21, "medianSeconds": 0.2, "factor": 1.5, "step": 300}
    conditions = plan.status.get("conditions") or again["conditions"]
    plan = reconcile.decide(
        observe(status=running_status(slowRank=none, conditions=conditions), jobs=[job(1, "Running")])
    )
    condition = next(c for c in plan.status["conditions"] if c["type"] == "SlowRank")
    assert (
        condition["status"] == "False"
        and condition["reason"] == "NoneSlow"
        and "since step 300" in condition["message"]
    )
    never = reconcile.decide(observe(status=running_status(slowRank=none), jobs=[job(1, "Running")]))
    assert not any(c["type"] == "SlowRank" for c in never.status.get("conditions", []))


def hang_at(time, *nodes, step=40):
    return {"step": step, "time": time, "diagnosis": "hang after step 40: ...", "ranks": [1], "nodes": list(nodes)}


def on_nodes(*nodes):
    """The run's pods, one on each node."""
    return [
        {**pod(1, {"phase": "Running"}, name=f"demo-a1-worker-{i}"), "spec": {"nodeName": n}}
        for i, n in enumerate(nodes)
    ]


def test_a_node_named_in_two_hangs_in_a_row_ends_the_attempt_and_later_attempts_avoid_it():
    first = running_status(lastHang=hang_at("2026-11-21T11:50:00Z", "gpu-7"))
    seen = functools.partial(observe, pods=on_nodes("gpu-7", "gpu-9"))
    plan = reconcile.decide(seen(status=first, jobs=[job(1, "Running")]))
    assert plan.status["hangNodes"] == {"time": "2026-11-21T11:50:00Z", "nodes": ["gpu-7"]}
    assert not plan.delete_jobs and "avoidedNodes" not in plan.status  # once is not yet a pattern

    other = running_status(lastHang=hang_at("2026-11-21T11:55:00Z", "gpu-9"), hangNodes=plan.status["hangNodes"])
    plan = reconcile.decide(seen(status=other, jobs=[job(1, "Running")]))
    assert not plan.delete_jobs and plan.status["hangNodes"]["nodes"] == ["gpu-9"]  # another node: not in a row

    again = running_status(
        lastHang=hang_at("2026-11-21T11:58:00Z", "gpu-9", "gpu-3"), hangNodes=plan.status["hangNodes"]
    )
    plan = reconcile.decide(seen(status=again, jobs=[job(1, "Running")]))
    assert plan.status["avoidedNodes"] == ["gpu-9"]
    assert plan.cordon_nodes == ["gpu-9"]  # cordoned where the chart allows it (plans.carry_out)
    assert plan.delete_jobs == ["demo-a1"] and plan.status["phase"] == "Recovering"
    assert plan.status["restarts"]["failures"] == 1  # charged as the hangs were
    said = [e.message for e in plan.events if e.reason == "AvoidingNode"]
    assert said and "node gpu-9 held the run up in two hangs in a row" in said[0] and "avoid gpu-9" in said[0]

    # the same hang seen again (the echo of that status write) decides nothing more
    echo = running_status(lastHang=again["lastHang"], hangNodes=plan.status["hangNodes"], avoidedNodes=["gpu-9"])
    assert not reconcile.decide(seen(status=echo, jobs=[job(1, "Running")])).delete_jobs

    # the next attempt's pods keep off the node, by name, in every pod template it builds
    recovering = running_status(
        phase="Recovering", nextAttemptTime="2026-11-21T11:00:00Z", avoidedNodes=["gpu-9"], lastHang=again["lastHang"]
    )
    plan = reconcile.decide(seen(status=recovering, jobs=[job(1, "Failed")]))
    assert plan.start_attempt == 2 and plan.avoid_nodes == ["gpu-9"]
    for backend in (pytorchjob, jobset):
        *_, built = backend.children(run_of(), 2, avoid_nodes=plan.avoid_nodes)
        text = json.dumps(built)
        assert '"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-9"]}]' in text


def test_a_report_cannot_make_the_operator_avoid_a_node_the_runs_pods_never_ran_on():
    """A hang report is a pod's word: naming another tenant's node twice moves (or cordons) nothing."""
    before = {"time": "2026-11-21T11:50:00Z", "nodes": ["their-node"]}
    again = running_status(lastHang=hang_at("2026-11-21T11:58:00Z", "their-node"), hangNodes=before)
    plan = reconcile.decide(observe(status=again, jobs=[job(1, "Running")], pods=on_nodes("gpu-7")))
    assert not plan.delete_jobs and not plan.cordon_nodes and "avoidedNodes" not in plan.status


def test_old_attempts_are_deleted_and_the_last_failed_one_kept():
    status = running_status(3, phase="Recovering", nextAttemptTime="2026-11-21T11:00:00Z")
    plan = reconcile.decide(observe(status=status, jobs=[job(1, "Failed"), job(2, "Failed"), job(3, "Failed")]))
    assert plan.start_attempt == 4 and plan.delete_jobs == ["demo-a1", "demo-a2"]


def test_a_finished_run_keeps_only_its_final_attempt():
    status = running_status(3, phase="Succeeded")
    plan = reconcile.decide(observe(status=status, jobs=[job(2, "Failed"), job(3, "Succeeded")]))
    assert plan.delete_jobs == ["demo-a2"] and plan.status == {} and plan.events == []


def test_reports_that_arrive_without_a_step_since_the_attempt_started_are_a_stall():
    run = run_of(recovery={"stallTimeoutSeconds": 60})
    status = running_status(lastReportTime=reconcile.rfc3339(NOW))  # heartbeats, no step
    plan = reconcile.decide(observe(run, status, [job(1, "Running", run=run)], now=NOW + timedelta(seconds=1)))
    assert plan.status["phase"] == "Recovering" and plan.delete_jobs == ["demo-a1"]
    stalled = next(e for e in plan.events if e.reason == "Stalled")
    assert "no step finished since attempt 1 started" in stalled.message and plan.restart_cause == "stall"


def test_no_reports_at_all_is_a_condition_not_a_restart():
    """Pods that cannot reach the report endpoint may be training: the run says so and restarts nothing;
    when reports arrive again the condition clears."""
    run = run_of(recovery={"stallTimeoutSeconds": 60})
    status = running_status(
        progress={"step": 40, "updatedAt": "2026-11-21T11:59:10Z"}, lastReportTime="2026-11-21T11:59:10Z"
    )
    later = NOW + timedelta(minutes=5)
    plan = reconcile.decide(observe(run, status, [job(1, "Running", run=run)], now=later))
    assert "phase" not in plan.status and plan.delete_jobs == [] and plan.restart_cause is None
    condition = next(c for c in plan.status["conditions"] if c["type"] == "ReportingUnavailable")
    assert condition["status"] == "True" and "stallTimeoutSeconds=60s" in condition["message"]
    assert [e.reason for e in plan.events] == ["ReportingUnavailable"]
    status = merged_status(status, plan.status)
    status.update(lastReportTime=reconcile.rfc3339(later), progress={"step": 90, "updatedAt": reconcile.rfc3339(later)})
    back = reconcile.decide(observe(run, status, [job(1, "Running", run=run)], now=later))
    assert next(c for c in back.status["conditions"] if c["type"] == "ReportingUnavailable")["status"] == "False"
    assert back.delete_jobs == []


def test_spec_change_is_pending_until_the_next_attempt():
    old = run_of(image="r/t:1")
    new = run_of(image="r/t:2")
    plan = reconcile.decide(observe(new, running_status(), [job(1, "Running", run=old)]))
    pending = next(c for c in plan.status["conditions"] if c["type"] == "SpecChangePending")
    assert pending["status"] == "True" and "applies from attempt 2" in pending["message"]
    suspend_only = run_of(image="r/t:1", suspend=False)
    assert reconcile.decide(observe(suspend_only, running_status(), [job(1, "Running", run=old)])).status == {}


def test_a_job_built_from_the_runs_generation_is_not_hashed_again():
    """The generation the job was built from settles "did the spec change?"; the spec hash only when it differs
    (a job of an older operator has no generation annotation)."""
    old, new = run_of(image="r/t:1"), run_of(image="r/t:2")
    old.metadata.generation, new.metadata.generation = 3, 4
    built = job(1, "Running", run=old)
    assert built["metadata"]["annotations"][naming.ANNOTATION_GENERATION] == "3"
    built["metadata"]["annotations"][naming.ANNOTATION_SPEC_DIGEST] = "not-this-spec"
    assert "conditions" not in reconcile.decide(observe(old, running_status(), [built])).status
    changed = reconcile.decide(observe(new, running_status(), [built]))
    assert next(c for c in changed.status["conditions"] if c["type"] == "SpecChangePending")["status"] == "True"
    del built["metadata"]["annotations"][naming.ANNOTATION_GENERATION]  # as an older operator built it
    hashed = reconcile.decide(observe(old, running_status(), [built]))
    assert next(c for c in hashed.status["conditions"] if c["type"] == "SpecChangePending")["status"] == "True"


@pytest.mark.parametrize("annotation", ["digest", "an older operator's hash"])
def test_a_spec_change_is_told_from_a_suspension_by_either_digest_the_job_carries(annotation):
    """A job of an older operator carries its spec hash (json.dumps), a new one the digest (orjson): each is compared
    with the same function that made it, so neither a resumed run nor an upgrade says the spec changed when it did
    not."""
    old = run_of(image="r/t:1")
    suspended, changed = run_of(image="r/t:1", suspend=True), run_of(image="r/t:2")
    for run, generation in ((old, 3), (suspended, 4), (changed, 5)):
        run.metadata.generation = generation
    built = job(1, "Running", run=old)
    annotations = built["metadata"]["annotations"]
    del annotations[naming.ANNOTATION_GENERATION]  # the digest decides
    if annotation != "digest":
        del annotations[naming.ANNOTATION_SPEC_DIGEST]
        annotations[naming.ANNOTATION_SPEC_HASH] = naming.legacy_spec_hash(old)
    assert naming.spec_digest(old) != naming.legacy_spec_hash(old)  # so a mix-up would show below

    def spec_change_pending(run) -> bool:
        conditions = reconcile.decide(observe(run, running_status(), [built])).status.get("conditions") or []
        return any(c["type"] == "SpecChangePending" and c["status"] == "True" for c in conditions)

    assert not spec_change_pending(suspended) and spec_change_pending(changed)


@pytest.mark.parametrize(
    "scenario", ["new", "running", "failed", "budget spent", "succeeded", "recovering", "secret", "stalled", "rejected"]
)
def test_deciding_again_after_the_plan_changes_nothing(scenario):
    """Level-triggered and idempotent: a reconcile right after another acts and says nothing. The operator relies on
    it: the watch event of the plan's own status write is not reconciled (handlers._decides_the_same_after)."""
    run, status, jobs, pods = run_of(recovery={"stallTimeoutSeconds": 600}), running_status(), [], []
    job = functools.partial(globals()["job"], run=run)
    if scenario == "running":
        jobs = [job(1, "Running")]
        status["phase"] = "Pending"
    elif scenario == "failed":
        jobs, pods = [job(1, "Failed")], [pod(1, ended(137, "OOMKilled"))]
    elif scenario == "budget spent":  # the run ends: the earlier attempt's job goes with that decision
        run = run_of(recovery={"maxFailures": 1, "backoffSeconds": 0, "stallTimeoutSeconds": 600})
        job = functools.partial(globals()["job"], run=run)
        status = running_status(2, restarts={"failures": 1, "preemptions": 0, "total": 1})
        jobs, pods = [job(1, "Failed"), job(2, "Failed")], [pod(2, ended(137, "OOMKilled"))]
    elif scenario == "succeeded":
        jobs, status = [job(1, "Failed"), job(2, "Succeeded")], running_status(2)
    elif scenario == "recovering":
        jobs, status = [job(1, "Failed")], running_status(phase="Recovering", nextAttemptTime="2026-11-21T11:00:00Z")
    elif scenario == "secret":
        jobs = [job(1, "Created")]
        pods = [
            pod(
                1,
                {
                    "containerStatuses": [
                        {
                            "name": "pytorch",
                            "state": {
                                "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}
                            },
                        }
                    ]
                },
            )
        ]
    elif scenario == "stalled":
        jobs, status["attemptStartTime"] = [job(1, "Running")], "2026-11-21T10:00:00Z"
    elif scenario == "rejected":
        jobs, run = (
            [job(1, "Running")],
            run_of(checkpoint={"uri": "s3://other/demo"}, recovery={"stallTimeoutSeconds": 600}),
        )
    if scenario == "new":
        status = {}
    first = reconcile.decide(observe(run, status, jobs, pods))
    assert first.status or first.events
    status = merged_status(status, first.status)
    jobs = [j for j in jobs if j["metadata"]["name"] not in first.delete_jobs]
    if first.start_attempt and not any(j["metadata"]["name"] == status["jobName"] for j in jobs):
        jobs.append(job(first.start_attempt))
    second = reconcile.decide(observe(run, status, jobs, pods))
    assert second.status == {} and second.events == [] and second.start_attempt is None
    assert second.delete_jobs == []


# ---------------------------------------------------------------- pods that never run


def pending_status(attempt=1):
    return {**running_status(attempt), "phase": "Pending"}


@pytest.mark.parametrize(
    "pods,warnings,type_,words",
    [
        (
            [
                pod(
                    1,
                    {
                        "conditions": [
                            {
                                "type": "PodScheduled",
                                "status": "False",
                                "reason": "Unschedulable",
                                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                            }
                        ]
                    },
                )
            ],
            [],
            "Unschedulable",
            "3 Insufficient nvidia.com/gpu",
        ),
        (
            [],
            [
                {
                    "reason": "FailedCreate",
                    "message": 'Error creating: pods "demo-a1-worker-0" is forbidden: exceeded quota',
                    "involvedObject": {"kind": "PyTorchJob", "name": "demo-a1"},
                }
            ],
            "PodsNotCreated",
            "exceeded quota",
        ),
        (
            [],
            [
                {
                    "reason": "FailedMount",
                    "message": 'MountVolume.SetUp failed for volume "data" : nfs: access denied',
                    "involvedObject": {"kind": "Pod", "name": "demo-a1-worker-0"},
                }
            ],
            "VolumeMountFailed",
            "nfs: access denied",
        ),
        (
            [
                pod(
                    1,
                    {
                        "containerStatuses": [
                            {
                                "name": "pytorch",
                                "state": {
                                    "waiting": {
                                        "reason": "ImagePullBackOff",
                                        "message": 'Back-off pulling image "registry.example/trainer:typo"',
                                    }
                                },
                            }
                        ]
                    },
                )
            ],
            [],
            "ImagePullFailed",
            'ImagePullBackOff: Back-off pulling image "registry.example/trainer:typo" (check spec.image',
        ),
    ],
)
def test_a_pending_attempt_says_why_its_pods_do_not_run(pods, warnings, type_, words):
    observed = observe(status=pending_status(), jobs=[job(1, "Created")], pods=pods)
    observed.warnings = warnings
    plan = reconcile.decide(observed)
    condition = next(c for c in plan.status["conditions"] if c["type"] == type_)
    assert condition["status"] == "True" and words in condition["message"]
    assert [e.reason for e in plan.events] == [type_]
    # once the attempt runs, the condition is cleared
    status = merged_status(pending_status(), plan.status)
    later = reconcile.decide(observe(status={**status, "phase": "Running"}, jobs=[job(1, "Created", "Running")]))
    assert next(c for c in later.status["conditions"] if c["type"] == type_)["status"] == "False"


def test_a_running_attempt_whose_replacement_pod_finds_no_node_says_so_and_is_not_a_stall():
    """A pod replaced within the attempt (deleted, evicted, node gone) can be Unschedulable while the run is
    Running: the run says so, and waiting for a node past stallTimeoutSeconds starts no new attempt."""
    run = run_of(recovery={"stallTimeoutSeconds": 60})
    status = running_status(
        attemptStartTime="2026-11-21T11:50:00Z", progress={"step": 40, "updatedAt": "2026-11-21T11:55:00Z"}
    )
    unschedulable = pod(
        1,
        {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 Insufficient cpu.",
                }
            ]
        },
    )
    plan = reconcile.decide(observe(run, status, [job(1, "Running", run=run)], [unschedulable]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "Unschedulable")
    assert condition["status"] == "True" and "Insufficient cpu" in condition["message"]
    assert [e.reason for e in plan.events] == ["Unschedulable"]
    assert "phase" not in plan.status and plan.delete_jobs == []
    # scheduled again, the stall check is back (rank 0 reports, the step does not move)
    status = merged_status(status, plan.status)
    status["lastReportTime"] = reconcile.rfc3339(NOW)
    later = reconcile.decide(observe(run, status, [job(1, "Running", run=run)], []))
    assert next(c for c in later.status["conditions"] if c["type"] == "Unschedulable")["status"] == "False"
    assert later.status["phase"] == "Recovering" and later.restart_cause == "stall"


def test_a_missing_secret_volume_is_secret_missing():
    observed = observe(status=pending_status(), jobs=[job(1, "Created")])
    observed.warnings = [
        {
            "reason": "FailedMount",
            "involvedObject": {"kind": "Pod", "name": "demo-a1-worker-0"},
            "message": 'MountVolume.SetUp failed for volume "gcs-key" : secret "gcs" not found',
        }
    ]
    plan = reconcile.decide(observed)
    condition = next(c for c in plan.status["conditions"] if c["type"] == "SecretMissing")
    assert condition["status"] == "True" and 'secret "gcs" not found' in condition["message"]
    assert not any(c["type"] == "VolumeMountFailed" for c in plan.status["conditions"])


@pytest.mark.parametrize(
    "kubelet_says,shown",
    [
        # What a kubelet says before its Secret cache has synced (seen in CI): the run names its Secrets.
        (
            "failed to sync secret cache: timed out waiting for the condition",
            "failed to sync secret cache: timed out waiting for the condition (the run reads Secrets s3, tracker)",
        ),
        ('secret "s3" not found', 'secret "s3" not found'),
        ("couldn't find key api-key in Secret ns/tracker", "couldn't find key api-key in Secret ns/tracker"),
    ],
)
def test_a_container_waiting_on_a_secret_names_the_secrets_the_run_reads(kubelet_says, shown):
    run = run_of(
        secrets={
            "s3Credentials": {"secretName": "s3"},
            "env": [
                {"name": "WANDB_API_KEY", "secretName": "tracker", "key": "api-key"},
                {"name": "OTHER", "secretName": "s3", "key": "other"},
            ],
        }
    )
    waiting = pod(
        1,
        {
            "containerStatuses": [
                {
                    "name": "pytorch",
                    "state": {"waiting": {"reason": "CreateContainerConfigError", "message": kubelet_says}},
                }
            ]
        },
    )
    plan = reconcile.decide(observe(run, pending_status(), [job(1, "Created", run=run)], [waiting]))
    condition = next(c for c in plan.status["conditions"] if c["type"] == "SecretMissing")
    assert condition["message"] == f"pod demo-a1-worker-0: {shown}"
    assert [n.message for n in plan.events if n.reason == "SecretMissing"] == [
        f"pod demo-a1-worker-0: {shown}; create it in namespace ns (no restart is charged while waiting)"
    ]


def test_pods_restarted_in_place_are_counted_once_each_with_an_event():
    """Kubeflow replaces a deleted, evicted or retryably failed pod within the attempt and marks the job
    Restarting (dropping Running) until it runs again: the run counts each such restart once, by the
    condition's transition time, and says so in an Event."""

    def restarting_job(since):
        built = job(1, "Restarting", since=since)
        built["status"]["conditions"][0]["message"] = (
            "PyTorchJob demo-a1 is restarting because 1 Worker replica(s) failed."
        )
        return built

    status = running_status()
    first = reconcile.decide(observe(status=status, jobs=[restarting_job(NOW)]))
    assert first.status["restarts"] == {
        "failures": 0,
        "preemptions": 0,
        "total": 0,
        "inPlace": 1,
        "lastInPlaceTime": reconcile.rfc3339(NOW),
    }
    assert [(n.reason, n.type) for n in first.events] == [("PodsRestarted", "Warning")]
    assert "because 1 Worker replica(s) failed" in first.events[0].message and "restart 1 " in first.events[0].message
    status = merged_status(status, first.status)
    assert reconcile.decide(observe(status=status, jobs=[restarting_job(NOW)])).events == []  # the same restart
    assert reconcile.decide(observe(status=status, jobs=[job(1, "Running")])).status.get("restarts") is None
    later = reconcile.decide(observe(status=status, jobs=[restarting_job(NOW + timedelta(minutes=5))]))
    assert later.status["restarts"]["inPlace"] == 2 and later.status["restarts"]["total"] == 0
    api_status.TrainingRunStatus.model_validate(merged_status(status, later.status))  # the CRD's status schema takes it


def suspended_status(attempt=1, **extra):
    return {**running_status(attempt), "phase": "Suspended", **extra}


def test_a_resume_waits_for_the_suspended_attempts_pods_to_be_gone():
    """On main the next attempt started at once, beside pods still writing their emergency checkpoint to the same
    prefix: it resumed from the checkpoint before that one, and both saved and rotated there at the same time."""
    stopping = pod(1, {"phase": "Running"}, deletionTimestamp="2026-11-21T11:59:50Z")
    plan = reconcile.decide(observe(run_of(), suspended_status(), [job(1, "Suspended")], [stopping]))
    assert plan.start_attempt is None and plan.delete_jobs == []
    waiting = next(c for c in plan.status["conditions"] if c["type"] == "WaitingForOldPods")
    assert waiting["status"] == "True" and "attempt 2 starts when they are gone" in waiting["message"]
    assert [n.reason for n in plan.events] == ["WaitingForOldPods"]

    gone = reconcile.decide(
        observe(
            run_of(),
            suspended_status(conditions=plan.status["conditions"]),
            [job(1, "Suspended")],
            [],
            now=NOW + timedelta(seconds=5),
        )
    )
    assert gone.start_attempt == 2 and gone.delete_jobs == ["demo-a1"]
    assert next(c for c in gone.status["conditions"] if c["type"] == "WaitingForOldPods")["reason"] == "OldPodsGone"


def test_a_resume_waits_no_longer_than_the_grace_period_and_some_slack():
    stopping = pod(1, {"phase": "Running"}, deletionTimestamp="2026-11-21T11:59:50Z")
    first = reconcile.decide(observe(run_of(), suspended_status(), [job(1, "Suspended")], [stopping]))
    grace = run_of().spec.termination_grace_period_seconds
    later = NOW + timedelta(seconds=grace) + reconcile.OLD_PODS_SLACK
    plan = reconcile.decide(
        observe(
            run_of(),
            suspended_status(conditions=first.status["conditions"]),
            [job(1, "Suspended")],
            [stopping],
            now=later,
        )
    )
    assert plan.start_attempt == 2
    assert (
        next(c for c in plan.status["conditions"] if c["type"] == "WaitingForOldPods")["reason"] == "WaitedLongEnough"
    )


def test_pods_that_already_ended_do_not_hold_a_resume():
    done = pod(1, {"phase": "Failed"})
    assert reconcile.decide(observe(run_of(), suspended_status(), [job(1, "Suspended")], [done])).start_attempt == 2


# ---------------------------------------------------------------- when a decision changes with the clock alone


def acts(plan):
    return plan.start_attempt, plan.delete_jobs, plan.status.get("phase"), sorted(n.reason for n in plan.events)


def _stalling():
    run = run_of(recovery={"stallTimeoutSeconds": 60})
    status = running_status(
        progress={"step": 40, "updatedAt": "2026-11-21T11:59:30Z"}, lastReportTime="2026-11-21T11:59:50Z"
    )
    return run, status, [job(1, "Running", run=run)], []


def _silent():
    run = run_of(recovery={"stallTimeoutSeconds": 60})
    status = running_status(
        progress={"step": 40, "updatedAt": "2026-11-21T11:59:50Z"}, lastReportTime="2026-11-21T11:59:50Z"
    )
    return run, status, [job(1, "Running", run=run)], []


CLOCK_SCENARIOS = {
    "backoff ends": lambda: (
        run_of(),
        running_status(phase="Recovering", nextAttemptTime="2026-11-21T12:00:30Z"),
        [job(1, "Failed")],
        [],
    ),
    "failure evidence grace ends": lambda: (run_of(), running_status(), [job(1, "Failed", since=NOW)], []),
    "a step is overdue": _stalling,
    "reports stop": _silent,
    "old pods outlive their grace": lambda: (
        run_of(),
        suspended_status(),
        [job(1, "Suspended")],
        [pod(1, {"phase": "Running"}, deletionTimestamp="2026-11-21T11:59:50Z")],
    ),
}


@pytest.mark.parametrize("scenario", CLOCK_SCENARIOS)
def test_a_decision_that_changes_with_the_clock_alone_says_when(scenario):
    """Rechecks reconcile a run at `recheck_at` instead of every run every few seconds: at that time, and not a second
    before, the same observation decides something else."""
    run, status, jobs, pods = CLOCK_SCENARIOS[scenario]()
    first = reconcile.decide(observe(run, status, jobs, pods))
    assert first.recheck_at is not None and first.recheck_at > NOW
    status = merged_status(status, first.status)
    just_before = reconcile.decide(observe(run, status, jobs, pods, now=first.recheck_at - timedelta(seconds=1)))
    due = reconcile.decide(observe(run, status, jobs, pods, now=first.recheck_at))
    assert acts(just_before) == (None, [], None, [])
    assert acts(due) != acts(just_before)


def test_an_attempt_ended_without_backoff_is_rechecked_at_once():
    """Its Recovering status comes back as a watch event that changes nothing the operator did not write, which is
    not reconciled: the next attempt starts from this recheck."""
    run = run_of(recovery={"backoffSeconds": 0})
    failed = job(1, "Failed")
    plan = reconcile.decide(observe(run, running_status(), [failed], [pod(1, ended(134))]))
    assert plan.status["phase"] == "Recovering" and plan.recheck_at == NOW
    status = merged_status(running_status(), plan.status)
    assert reconcile.decide(observe(run, status, [failed], [pod(1, ended(134))])).start_attempt == 2


def test_a_decision_acted_on_asks_for_no_recheck_of_the_same_time():
    """No reports for longer than the stall timeout: the condition is set once; deciding again at a later time must
    not ask to be reconciled at a time already past, over and over."""
    run, status, jobs, pods = _silent()
    later = NOW + timedelta(minutes=5)
    first = reconcile.decide(observe(run, status, jobs, pods, now=later))
    assert any(c["type"] == "ReportingUnavailable" for c in first.status["conditions"])
    again = reconcile.decide(observe(run, merged_status(status, first.status), jobs, pods, now=later))
    assert again.recheck_at is None or again.recheck_at > later


def test_a_decision_only_events_change_sets_no_recheck():
    pending = {**running_status(), "phase": "Pending"}
    assert reconcile.decide(observe(status=pending, jobs=[job(1)])).recheck_at is None
    assert reconcile.decide(observe(status=running_status(3, phase="Succeeded"))).recheck_at is None


# ---------------------------------------------------------------- the JobSet backend


def jobset_job(attempt, *conditions, run=None, since=NOW, ready=0):
    from trainingrun_operator import jobset

    built = jobset.jobset(run or run_of(), attempt)
    built["metadata"]["uid"] = f"js-{attempt}"
    built["status"] = {
        "conditions": [
            {"type": c, "status": "True", "lastTransitionTime": reconcile.rfc3339(since)} for c in conditions
        ],
        "replicatedJobsStatus": [{"name": "worker", "ready": ready}],
    }
    return built


def observe_jobset(status=None, jobs=(), pods=(), parts=(), run=None):
    from trainingrun_operator import backends

    observed = observe(run, status, jobs, pods)
    observed.backend, observed.parts = backends.JOBSET, list(parts)
    return observed


def test_a_jobset_run_records_its_backend_and_says_so():
    plan = reconcile.decide(observe_jobset())
    assert plan.start_attempt == 1 and plan.status["backend"] == "JobSet" and plan.backend.kind == "JobSet"
    assert [n.message for n in plan.events] == ["attempt 1 started (JobSet demo-a1), from the start"]


def test_a_jobset_attempt_runs_and_completes():
    pending = {**running_status(), "phase": "Pending", "backend": "JobSet"}
    started = reconcile.decide(observe_jobset(pending, [jobset_job(1)], [pod(1, {"phase": "Running"})]))
    assert started.status["phase"] == "Running"
    assert [n.message for n in started.events] == ["attempt 1 is running (JobSet demo-a1)"]
    done = reconcile.decide(observe_jobset({**pending, "phase": "Running"}, [jobset_job(1, "Completed")]))
    assert done.status["phase"] == "Succeeded"


def test_a_failed_jobset_is_classified_from_its_pods_and_retried_by_the_operator():
    status = {**running_status(), "backend": "JobSet"}
    killed = pod(1, ended(137, "OOMKilled"))
    plan = reconcile.decide(observe_jobset(status, [jobset_job(1, "Failed")], [killed]))
    assert plan.status["phase"] == "Recovering" and plan.status["restarts"]["failures"] == 1
    assert (
        plan.restart_cause == "failure"
        and "pod demo-a1-worker-0 exited with 137 (OOMKilled)" in plan.events[-1].message
    )
    permanent = reconcile.decide(observe_jobset(status, [jobset_job(1, "Failed")], [pod(1, ended(2))]))
    assert permanent.status["phase"] == "Failed"


def test_pods_a_jobsets_job_replaced_are_counted_in_place_and_the_count_starts_again_with_the_next_attempt():
    status = {**running_status(), "backend": "JobSet"}
    part = {"metadata": {"name": "demo-a1-worker-0"}, "status": {"failed": 1}}
    first = reconcile.decide(observe_jobset(status, [jobset_job(1, ready=1)], parts=[part]))
    assert first.status["restarts"]["inPlace"] == 1 and first.status["restarts"]["attemptPodsFailed"] == 1
    assert [n.reason for n in first.events] == ["PodsRestarted"] and "its Job allows 3 per attempt" in first.events[
        0
    ].message
    status = merged_status(status, first.status)
    assert "restarts" not in reconcile.decide(observe_jobset(status, [jobset_job(1, ready=1)], parts=[part])).status
    recovering = {**status, "phase": "Recovering", "nextAttemptTime": reconcile.rfc3339(NOW)}
    next_attempt = reconcile.decide(observe_jobset(recovering, [jobset_job(1, "Failed")]))
    assert next_attempt.start_attempt == 2
    assert next_attempt.status["restarts"]["attemptPodsFailed"] is None  # removed: the new Job counts from 0
    assert next_attempt.status["restarts"]["inPlace"] == 1  # the run's count stays


def test_a_jobset_is_suspended_with_its_own_field():
    status = {**running_status(), "backend": "JobSet"}
    plan = reconcile.decide(observe_jobset(status, [jobset_job(1, ready=1)], run=run_of(suspend=True)))
    assert plan.suspend_job == "demo-a1" and plan.backend.suspend_patch() == {"spec": {"suspend": True}}


def test_a_jobsets_pods_not_created_are_said_from_its_jobs_events():
    """The Job controller records FailedCreate on the JobSet's Job (`<jobset>-worker-0`), not on the JobSet."""
    observed = observe_jobset(pending_status(), [jobset_job(1)])
    observed.warnings = [
        {
            "reason": "FailedCreate",
            "message": 'Error creating: pods "demo-a1-worker-0-0-x" is forbidden: exceeded quota',
            "involvedObject": {"kind": "Job", "name": "demo-a1-worker-0"},
        }
    ]
    condition = next(c for c in reconcile.decide(observed).status["conditions"] if c["type"] == "PodsNotCreated")
    assert condition["message"].startswith("Job demo-a1-worker-0 of JobSet demo-a1: Error creating")


@pytest.mark.parametrize("backend", ["PyTorchJob", "JobSet"])
def test_a_run_suspended_before_its_new_job_was_seen_suspends_that_job(backend):
    """The job created a moment ago, the watch not yet there: suspending must still reach it (it did not: the run said
    Suspended while its JobSet ran on, as a recorded lifecycle showed)."""
    from trainingrun_operator import backends

    status = {**pending_status(), "backend": backend}
    observed = observe(run_of(suspend=True), status, jobs=[])
    observed.backend = backends.JOBSET if backend == "JobSet" else backends.PYTORCHJOB
    plan = reconcile.decide(observed)
    assert plan.status["phase"] == "Suspended" and plan.suspend_job == "demo-a1"
