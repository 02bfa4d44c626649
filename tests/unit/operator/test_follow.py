"""`trainingrun status`: what a user reads about a run, from the TrainingRun as the API server stores it."""

from datetime import datetime, timezone

from trainingrun_operator import follow

RUNNING = {
    "phase": "Running",
    "attempt": 2,
    "jobName": "demo-a2",
    "progress": {
        "step": 1200,
        "totalSteps": 3000,
        "loss": 1.23456,
        "samplesPerSecond": 640.0,
        "percent": 40.0,
        "estimatedCompletionTime": "2026-11-24T18:32:32Z",
        "updatedAt": "2026-11-24T18:31:02Z",
    },
    "goodput": 0.934,
    "restarts": {"failures": 1, "preemptions": 0, "total": 1, "inPlace": 2},
    "lastGoodCheckpoint": {"uri": "s3://bucket/runs/demo/step-00001200", "step": 1200, "time": "2026-11-24T18:31:02Z"},
    "conditions": [{"type": "Ready", "status": "True", "reason": "AttemptRunning", "message": "attempt 2 is running"}],
}
NOW = datetime(2026, 11, 24, 18, 31, 2, tzinfo=timezone.utc)


def with_status(body, status, **spec):
    return {**body, "spec": {**body["spec"], **spec}, "status": status}


def test_a_running_run_shows_progress_eta_goodput_checkpoint_and_conditions(minimal_body):
    lines = follow.status_lines(with_status(minimal_body, RUNNING, trainer={"maxSteps": 3000}), now=NOW)
    assert lines == [
        "TrainingRun team-a/demo: Running, attempt 2 (PyTorchJob demo-a2)",
        "  progress    step 1200/3000 (40%), loss 1.2346, 640 samples/s, ETA ~1m30s (2026-11-24T18:32:32Z)",
        "  goodput     0.93 (restarts: 1 failed, 0 preempted, 2 in place)",
        "  checkpoint  step 1200 at s3://bucket/runs/demo/step-00001200 (2026-11-24T18:31:02Z)",
        "  condition   Ready=True AttemptRunning: attempt 2 is running",
    ]


def test_model_flops_mfu_and_a_checkpoint_ahead_in_memory_are_shown_when_reported(minimal_body):
    reported = {
        **RUNNING,
        "progress": {**RUNNING["progress"], "modelFlopsPerSecond": 4.2e14, "mfu": 0.4245},
        "checkpointInMemory": {"step": 1250, "time": "2026-11-24T18:31:40Z"},
    }
    lines = follow.status_lines(with_status(minimal_body, reported), now=NOW)
    assert ", 420 TFLOP/s (MFU 42%)" in lines[1]
    assert lines[4] == (
        "  in memory   step 1250 (2026-11-24T18:31:40Z), not in storage yet: a restart inside the pod resumes from it"
    )
    cpu = {**RUNNING, "progress": {**RUNNING["progress"], "modelFlopsPerSecond": 2.5e9}}
    assert ", 0.0025 TFLOP/s, ETA" in follow.status_lines(with_status(minimal_body, cpu), now=NOW)[1]


def test_the_eta_is_the_operators_estimate_shown_while_running(minimal_body):
    """The operator's estimatedCompletionTime (the step rate between reports, so an elastic run has one too), the
    same figure as status and the kubectl column; none without it, and none once the run is not running."""
    elastic = with_status(minimal_body, RUNNING, replicas={"min": 1, "max": 2})
    assert "ETA ~1m30s" in follow.status_lines(elastic, now=NOW)[1]
    no_estimate = {
        **RUNNING,
        "progress": {k: v for k, v in RUNNING["progress"].items() if k != "estimatedCompletionTime"},
    }
    assert "ETA" not in follow.status_lines(with_status(minimal_body, no_estimate), now=NOW)[1]
    assert "ETA ~0m00s" in follow.status_lines(with_status(minimal_body, RUNNING), now=NOW.replace(hour=19))[1]
    suspended = {**RUNNING, "phase": "Suspended"}
    assert "ETA" not in follow.status_lines(with_status(minimal_body, suspended), now=NOW)[1]


def test_a_new_run_says_what_it_waits_for(minimal_body):
    assert follow.status_lines(minimal_body) == [
        "TrainingRun team-a/demo: Pending (not seen by the operator yet)",
        "  progress    no step reported yet",
        "  goodput     - (restarts: 0 failed, 0 preempted, 0 in place)",
        "  checkpoint  none committed yet (writes to s3://bucket/runs/demo)",
    ]


class ScriptedCluster:
    """A run's life as a list of moments; each poll (`wait`) moves to the next, and a followed log moves on when
    its container ends. A moment: the run's status, and each pod's container (identity, state, log lines)."""

    def __init__(self, body, moments):
        self.body, self.moments, self.now = body, moments, 0

    def run(self):
        return {**self.body, "status": self.moments[self.now]["status"]}

    def container(self, pod):
        found = self.moments[self.now]["pods"].get(pod)
        return found[:2] if found else None

    def worker_pod(self, attempt, index):
        """A JobSet's pods are found by their labels: here, the newest named for the attempt and index."""
        prefix = f"demo-a{attempt}-worker-0-{index}-"
        return max((p for p in self.moments[self.now]["pods"] if p.startswith(prefix)), default=None)

    def lines(self, pod, follow):
        yield from self.moments[self.now]["pods"][pod][2]
        if follow:  # the stream ends when the container does
            self.now += 1

    def wait(self, seconds):
        self.now += 1


def moment(phase, attempt, **pods):
    return {"status": {"phase": phase, "attempt": attempt}, "pods": pods}


def test_logs_follow_a_run_across_a_failed_attempt(minimal_body):
    import io

    a1, a2 = "demo-a1-worker-0", "demo-a2-worker-0"
    cluster = ScriptedCluster(
        minimal_body,
        [
            moment("Running", 1, **{a1: ("u1/0", "running", ["step 1", "step 2"])}),
            moment("Recovering", 1, **{a1: ("u1/0", "terminated", ["step 1", "step 2"])}),
            moment("Pending", 2),
            moment("Running", 2, **{a2: ("u2/0", "running", ["resumed from step 2", "step 3"])}),
            moment("Succeeded", 2, **{a2: ("u2/0", "terminated", ["resumed from step 2", "step 3"])}),
        ],
    )
    out = io.StringIO()
    assert follow.follow_logs(cluster, follow=True, out=out, wait=cluster.wait) == 0
    assert out.getvalue().splitlines() == [
        "==> attempt 1, pod demo-a1-worker-0 <==",
        "step 1",
        "step 2",
        "==> demo-a1-worker-0 ended; waiting for it to restart or for the next attempt <==",
        "==> waiting for pod demo-a2-worker-0 (attempt 2) <==",
        "==> attempt 2, pod demo-a2-worker-0 <==",
        "resumed from step 2",
        "step 3",
        "==> run Succeeded in attempt 2 <==",
    ]


def test_logs_of_one_attempt_of_a_restarted_pod(minimal_body):
    import io

    import pytest

    pod = "demo-a1-worker-1"
    two_pods = {**minimal_body, "spec": {**minimal_body["spec"], "replicas": {"min": 2}, "nprocPerNode": 2}}
    cluster = ScriptedCluster(
        two_pods,
        [
            moment("Running", 1, **{pod: ("u1/0", "running", ["rank 2 step 1"])}),
            moment("Running", 1, **{pod: ("u1/0", "terminated", ["rank 2 step 1"])}),
            moment("Running", 1, **{pod: ("u1/1", "running", ["rank 2 resumed"])}),  # restarted in place
            moment("Running", 2, **{pod: ("u1/1", "terminated", ["rank 2 resumed"])}),
        ],
    )
    out = io.StringIO()
    assert follow.follow_logs(cluster, pod_index=1, attempt=1, follow=True, out=out, wait=cluster.wait) == 0
    assert out.getvalue().splitlines() == [
        "==> attempt 1, pod demo-a1-worker-1 <==",
        "rank 2 step 1",
        "==> demo-a1-worker-1 ended; waiting for it to restart or for the next attempt <==",
        "==> attempt 1, pod demo-a1-worker-1 <==",
        "rank 2 resumed",
        "==> attempt 1 is over (the run is in attempt 2) <==",
    ]
    with pytest.raises(follow.NothingToShow, match="--pod 2: the run has at most 2 pod"):
        follow.follow_logs(cluster, pod_index=2, out=out)
    with pytest.raises(follow.NothingToShow, match="pod demo-a3-worker-0 has not started yet; add -f"):
        follow.follow_logs(ScriptedCluster(minimal_body, [moment("Pending", 3)]), out=out)


def test_logs_follow_a_jobset_worker_across_its_replacement_pod(minimal_body):
    """A JobSet's Job replaces a lost pod with a new name (`<jobset>-worker-0-<index>-<random>`): the log goes on
    with the replacement, found by its labels, and `trainingrun status` names the JobSet."""
    import io

    first, replacement = "demo-a1-worker-0-1-aaaaa", "demo-a1-worker-0-1-bbbbb"

    def jobset_moment(phase, **pods):
        return {"status": {"phase": phase, "attempt": 1, "backend": "JobSet", "jobName": "demo-a1"}, "pods": pods}

    two_pods = {**minimal_body, "spec": {**minimal_body["spec"], "replicas": {"min": 2}}}
    cluster = ScriptedCluster(
        two_pods,
        [
            jobset_moment("Running", **{first: ("u1/0", "running", ["step 1"])}),
            jobset_moment("Running", **{first: ("u1/0", "terminated", ["step 1"])}),
            jobset_moment("Running", **{replacement: ("u2/0", "running", ["resumed from step 1", "step 2"])}),
            jobset_moment("Succeeded", **{replacement: ("u2/0", "terminated", ["resumed from step 1", "step 2"])}),
        ],
    )
    out = io.StringIO()
    assert follow.follow_logs(cluster, pod_index=1, follow=True, out=out, wait=cluster.wait) == 0
    assert out.getvalue().splitlines() == [
        f"==> attempt 1, pod {first} <==",
        "step 1",
        f"==> {first} ended; waiting for it to restart or for the next attempt <==",
        f"==> attempt 1, pod {replacement} <==",
        "resumed from step 1",
        "step 2",
        "==> run Succeeded in attempt 1 <==",
    ]
    head = follow.status_lines({**two_pods, "status": cluster.moments[0]["status"]})[0]
    assert head == "TrainingRun team-a/demo: Running, attempt 1 (JobSet demo-a1)"


def test_logs_hang_prints_the_newest_diagnosis_from_the_pod_that_logged_it(minimal_body):
    import io

    import pytest

    hang = {"step": 40, "time": "2026-11-24T18:31:02Z", "diagnosis": "hang after step 40: ... waited for rank 1"}
    earlier = "2026-11-24 18:20:00,000 rank0 ERROR trainingrun.hangs: hang diagnosis: hang after step 9: old"
    newest = [
        "2026-11-24 18:31:02,000 rank1 ERROR trainingrun.hangs: hang diagnosis: hang after step 40: waited for rank 0",
        "2026-11-24 18:31:02,001 rank1 ERROR trainingrun.hangs: hang diagnosis:   rank 0 (pod p0): did not answer",
    ]
    pods = {
        "demo-a1-worker-0": ("u0", "running", [earlier, "step 41"]),
        "demo-a1-worker-1": ("u1", "running", ["step 40", *newest, "step 41"]),
    }
    cluster = ScriptedCluster(minimal_body, [{"status": {"attempt": 1, "lastHang": hang}, "pods": pods}])
    cluster.worker_pod = lambda attempt, index: f"demo-a{attempt}-worker-{index}"  # a PyTorchJob's names
    out = io.StringIO()
    body = {**minimal_body, "spec": {**minimal_body["spec"], "replicas": {"min": 2, "max": 2}}}
    cluster.body = body
    assert follow.last_hang(cluster, out=out) == 0
    assert out.getvalue().splitlines() == [
        "==> the last hang: after step 40, diagnosed 2026-11-24T18:31:02Z <==",
        "==> pod demo-a1-worker-1 <==",
        "hang after step 40: waited for rank 0",
        "  rank 0 (pod p0): did not answer",
    ]
    cluster.moments[0]["status"] = {"attempt": 1}
    with pytest.raises(follow.NothingToShow, match="has had no hang"):
        follow.last_hang(cluster, out=io.StringIO())
