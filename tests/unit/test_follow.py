"""`trainingrun status`: what a user reads about a run, from the TrainingRun as the API server stores it."""
from trainingrun_operator import follow

RUNNING = {
    "phase": "Running", "attempt": 2, "jobName": "demo-a2",
    "progress": {"step": 1200, "totalSteps": 3000, "loss": 1.23456, "samplesPerSecond": 640.0},
    "goodput": 0.934, "restarts": {"failures": 1, "preemptions": 0, "total": 1, "inPlace": 2},
    "lastGoodCheckpoint": {"uri": "s3://bucket/runs/demo/step-00001200", "step": 1200, "time": "2026-11-24T18:31:02Z"},
    "conditions": [{"type": "Ready", "status": "True", "reason": "AttemptRunning", "message": "attempt 2 is running"}],
}


def with_status(body, status, **spec):
    return {**body, "spec": {**body["spec"], **spec}, "status": status}


def test_a_running_run_shows_progress_eta_goodput_checkpoint_and_conditions(minimal_body):
    # 32 samples per step (batch 32, one process, one pod) at 640 samples/s: 1800 steps left take 90 s
    lines = follow.status_lines(with_status(minimal_body, RUNNING, trainer={"maxSteps": 3000}))
    assert lines == [
        "TrainingRun team-a/demo: Running, attempt 2 (PyTorchJob demo-a2)",
        "  progress    step 1200/3000 (40%), loss 1.2346, 640 samples/s, ETA ~1m30s",
        "  goodput     0.93 (restarts: 1 failed, 0 preempted, 2 in place)",
        "  checkpoint  step 1200 at s3://bucket/runs/demo/step-00001200 (2026-11-24T18:31:02Z)",
        "  condition   Ready=True AttemptRunning: attempt 2 is running",
    ]


def test_the_estimate_counts_every_process_and_is_left_out_when_the_world_can_change(minimal_body):
    two_pods = with_status(minimal_body, RUNNING, replicas={"min": 2}, nprocPerNode=2)
    assert "ETA ~6m00s" in follow.status_lines(two_pods)[1]  # 4 x 32 samples per step
    elastic = with_status(minimal_body, RUNNING, replicas={"min": 1, "max": 2})
    assert "ETA" not in follow.status_lines(elastic)[1]


def test_a_new_run_says_what_it_waits_for(minimal_body):
    assert follow.status_lines(minimal_body) == [
        "TrainingRun team-a/demo: Pending (not seen by the operator yet)",
        "  progress    no step reported yet",
        "  goodput     - (restarts: 0 failed, 0 preempted, 0 in place)",
        "  checkpoint  none committed yet (writes to s3://bucket/runs/demo)",
    ]
