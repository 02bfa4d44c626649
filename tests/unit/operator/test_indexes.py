"""indexes.py: what the operator keeps of a run, and when a run's watch event needs a reconcile."""

import copy

from trainingrun_operator import naming, pytorchjob, validation
from trainingrun_operator.backends import PYTORCHJOB
from trainingrun_operator.indexes import SPEC_JSON, forget_shown, job_view, merged_status, slim_job, slim_run, view
from trainingrun_operator.settings import Settings

RUN = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "demo", "namespace": "ns", "uid": "u1", "generation": 1, "resourceVersion": "10"},
    "spec": {"checkpoint": {"uri": "s3://bucket/demo"}},
    "status": {"phase": "Pending", "attempt": 1},
}


def event(**changes):
    body = copy.deepcopy(RUN)
    for path, value in changes.items():
        where, key = path.split("__")
        body[where][key] = value
    return body


def test_a_status_event_reuses_the_spec_text_and_a_spec_change_does_not():
    first = slim_run(RUN)
    status_only = slim_run(event(status__phase="Running", metadata__resourceVersion="11"), first)
    assert status_only[SPEC_JSON] is first[SPEC_JSON]  # not dumped again
    edited = event(spec__suspend=True, metadata__generation=2)
    assert '"suspend":true' in slim_run(edited, first)[SPEC_JSON]
    recreated = event(spec__suspend=True, metadata__uid="u2")  # same name and generation, another object
    assert '"suspend":true' in slim_run(recreated, first)[SPEC_JSON]


def test_only_the_echo_of_the_last_reconciles_write_matches_its_view():
    """The view a reconcile records (what it read, with its own status write merged in) equals that of the watch event
    its write brings back; a report's write, a label, a spec change or someone else's status edit do not."""
    before = slim_run(RUN)
    written = {"phase": "Running", "observedGeneration": 1}
    recorded = view(before, merged_status(before["status"], written))
    echo = slim_run(event(status__phase="Running", status__observedGeneration=1), before)
    assert view(echo, merged_status(echo["status"], written)) == recorded
    reported = {**written, "lastReportTime": "2026-11-28T01:00:00Z"}  # the report endpoint wrote since
    assert view(echo, merged_status(echo["status"], reported)) != recorded
    labelled = slim_run(event(metadata__labels={"team": "a"}, status__phase="Running", status__observedGeneration=1))
    assert view(labelled, merged_status(labelled["status"], written)) != recorded
    edited = slim_run(event(spec__suspend=True, metadata__generation=2, status__phase="Running"), before)
    assert view(edited, merged_status(edited["status"], written)) != recorded
    touched = slim_run(event(status__phase="Running", status__observedGeneration=1, status__goodput=0.5), before)
    assert view(touched, merged_status(touched["status"], written)) != recorded


def test_what_the_watch_shows_is_no_longer_remembered_as_written():
    written = {"phase": "Recovering", "attempt": 2, "nextAttemptTime": None, "progress": {"step": 40}}
    older = {"phase": "Running", "attempt": 1, "nextAttemptTime": "2026-11-28T01:00:00Z", "progress": {"step": 40}}
    forget_shown(written, older)  # an event from before the write shows only what did not change
    assert written == {"phase": "Recovering", "attempt": 2, "nextAttemptTime": None}
    forget_shown(written, {"phase": "Recovering", "attempt": 2, "progress": {"step": 40}})  # the write's own event
    assert written == {}  # nextAttemptTime, removed, shows as absent


def as_the_server_shows(sent, **status):
    """A job as the watch brings it back: what the server assigns on create, and any status since."""
    shown = copy.deepcopy(sent)
    shown["metadata"].update(
        uid="j1", creationTimestamp="2026-11-28T14:00:00Z", resourceVersion="12", generation=1, managedFields=[{}]
    )
    if status:
        shown["status"] = status
    return shown


def test_the_job_a_reconcile_sent_matches_the_watchs_first_event_of_it_and_nothing_later():
    """A job event whose jobs are as the last reconcile left them is not reconciled (handlers.job_event): the job it
    created must have the view of the watch's ADDED event, and any change the run's decision reads must not."""
    run = validation.parse(
        {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", **{k: RUN[k] for k in ("metadata", "spec")}}
    )
    sent = pytorchjob.pytorch_job(run, 1, Settings(signing_key=b"k" * 32))
    left = job_view(slim_job(sent, PYTORCHJOB))
    assert job_view(slim_job(as_the_server_shows(sent), PYTORCHJOB)) == left
    created = {"conditions": [{"type": "Created", "status": "True", "lastTransitionTime": "2026-11-28T14:00:01Z"}]}
    assert job_view(slim_job(as_the_server_shows(sent, **created), PYTORCHJOB)) != left  # Kubeflow saw it
    changed = [
        as_the_server_shows(sent, **created),
        {**as_the_server_shows(sent), "spec": {**sent["spec"], "runPolicy": {"suspend": True}}},
    ]
    for edit in ({"deletionTimestamp": "2026-11-28T14:00:02Z"}, {"labels": {}}, {"annotations": {}}):
        edited = as_the_server_shows(sent)
        edited["metadata"].update(edit)
        changed.append(edited)
    signed = as_the_server_shows(sent)  # plans.JobSigner's patch after the creation: ownership may have changed
    signed["metadata"]["annotations"] = {**sent["metadata"]["annotations"], naming.ANNOTATION_SIGNATURE: "v2.0"}
    assert [job_view(slim_job(job, PYTORCHJOB)) == left for job in [*changed, signed]] == [False] * 6


def test_a_pod_is_kept_with_its_phase_which_decisions_read():
    """reconcile reads a pod's phase (a JobSet attempt runs once a pod does; a resume waits only for pods still
    stopping): the index kept none, so a suspended run's finished pods held its resume for their grace period."""
    from test_reconcile import observe, pod, run_of, suspended_status

    from trainingrun_operator import reconcile
    from trainingrun_operator.indexes import slim_pod

    finished = slim_pod(pod(1, {"phase": "Succeeded", "containerStatuses": []}))
    assert finished["status"]["phase"] == "Succeeded"
    suspended = suspended_status()
    plan = reconcile.decide(observe(run_of(), suspended, [], [finished]))
    assert plan.start_attempt == 2
