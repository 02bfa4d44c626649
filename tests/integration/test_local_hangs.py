"""Hangs under `trainingrun local`: a rank stopped, blocked before a collective, or whose data loader blocks is found
by the hang watch (hangs.py) in real torchrun processes over gloo, named in the diagnosis with where it was, and the
worker group restarts in place and finishes the run from its last checkpoint. A straggler (stragglers.py) is named
while the run goes on."""

import re
import signal

import pytest
from test_local_runs import INTERVAL, breakdown_of, local, result_of, training_run, write_run

from trainingrun_api import contract

pytestmark = pytest.mark.slow

#: Short, so the tests are quick; `auto` (at least 30 s) is the detector's unit tests' business.
HANG_TIMEOUT = 8
HANG_AFTER = 25


@pytest.mark.parametrize(
    "kind, rank, nodes, blamed",
    [
        ("stop", 1, 1, r"waited for rank 1 \(pod [^)]+\), which did not answer"),
        ("data", 1, 1, r"waited for rank 1 \(pod [^)]+\), at trainingrun_trainer/chaos\.py:\d+ in block_forever < "
         r"trainingrun_trainer/chaos\.py:\d+ in data_gate"),
        ("block", 0, 1, r"waited for rank 0 \(pod [^)]+\), at trainingrun_trainer/chaos\.py:\d+ in block_forever < "
         r"trainingrun_trainer/chaos\.py:\d+ in after_step"),
        # On another node (pod): its identity reaches the others through the shared group key, and its node's agent,
        # restarting its group because a peer's failed, counts no restart: the new group must not hang again.
        ("block", 1, 2, r"waited for rank 1 \(pod demo-a1-worker-1\), at trainingrun_trainer/chaos\.py:\d+ in "
         r"block_forever"),
        # Stopped on another node, with no pod-mate to end it: its own launcher kills it when asked.
        ("stop", 1, 2, r"waited for rank 1 \(pod demo-a1-worker-1\), which did not answer"),
    ],
    ids=["stop", "data", "block", "block-on-another-node", "stop-on-another-node"],
)  # fmt: skip
def test_a_hung_rank_is_named_and_the_run_goes_on(tmp_path, kind, rank, nodes, blamed):
    body = training_run()
    body["spec"]["recovery"]["hangTimeoutSeconds"] = HANG_TIMEOUT
    if nodes > 1:
        body["spec"]["nprocPerNode"] = 1
    flags = ("--chaos-hang", f"{kind}:{HANG_AFTER}:{rank}", "--nodes", str(nodes))
    done = local(tmp_path, write_run(tmp_path, body), *flags)

    assert done.returncode == 0, done.stdout + done.stderr
    result = result_of(done.stdout)
    assert result["steps"] == "60" and result["hangs"] == "1" and result["restarts_in_place"] == "1"
    # rank 0 (alive in every case here) reported its time to the diagnosis as hang, not as start-up
    assert breakdown_of(done.stdout)["hang"] >= HANG_TIMEOUT, done.stdout
    hang = [line for line in done.stdout.splitlines() if line.startswith("hang 1 of 1: ")]
    assert hang, done.stdout
    assert f"hang after step {HANG_AFTER}: no progress for" in hang[0]
    assert re.search(r"all_reduce #\d+ of process group 0", hang[0]), hang[0]
    assert re.search(blamed, hang[0]), hang[0]
    log = (tmp_path / "runs" / "demo" / "attempt-1.log").read_text()
    last_commit = HANG_AFTER - HANG_AFTER % INTERVAL  # the restarted group resumes from the newest commit before it
    assert re.search(
        rf"resumed from \S+/step-0*{last_commit} at step {last_commit} in [\d.]+ s, reading node memory", log
    )
    if kind == "stop" and nodes == 1:  # the stopped rank is killed by its pod-mate, not left to torchrun's 30 s
        assert f"rank {rank} (pid " in log and "killing it so that the worker group restarts now" in log
    if kind == "stop" and nodes == 2:  # by its pod's launcher, asked through the rendezvous store
        its_node = (tmp_path / "runs" / "demo" / "attempt-1-node-1.log").read_text()
        assert "did not answer a hang: killing it so that the worker group restarts now" in its_node


def test_a_chaos_hang_that_cannot_work_is_refused_before_anything_starts(tmp_path):
    body = training_run()
    body["spec"]["nprocPerNode"] = 1
    done = local(tmp_path, write_run(tmp_path, body), "--chaos-hang", "stop:10")

    assert done.returncode == 2
    assert "a stopped rank is found by the ranks still running" in done.stderr and "--nproc 2" in done.stderr
    done = local(tmp_path, write_run(tmp_path, training_run()), "--chaos-hang", "freeze:10")
    assert done.returncode == 2 and "KIND one of stop, block, data" in done.stderr


@pytest.mark.parametrize("rank", [1, 0])
def test_a_slow_rank_is_named_with_how_much_slower_and_the_run_goes_on(tmp_path, rank):
    process = local(
        tmp_path,
        write_run(tmp_path, training_run(maxSteps=1000000, logIntervalSteps=50)),
        "--chaos-slow-rank",
        f"3:{rank}",
        start_new_session=True,
    )
    named = ""
    for line in process.stdout:  # named within a minute or so: SUSTAIN_SECONDS past the factor, then said
        if ": slow rank " in line:
            named = line
            break
    process.send_signal(signal.SIGINT)  # then Ctrl-C: it checkpoints and stops
    stdout, stderr = process.communicate(timeout=120)
    assert named, stdout + stderr[-3000:]
    found = re.search(r"slow rank (\d+) \(pod [^)]+\) takes ([\d.]+)x the other ranks' time", named)
    assert found and int(found.group(1)) == rank, named
    # Named only at slowRankFactor (default 1.5) or more. The injected 3x is of the slow rank's own part: the ratio to
    # the others' moves with the machine's load (1.92x once on CI's 2 cores, where rank 0's threads share them).
    assert float(found.group(2)) >= contract.DEFAULT_SLOW_RANK_FACTOR, named
    assert process.returncode == 130 and "slow rank 1 of 1: rank" in stdout and " slow_ranks=1" in stdout
    assert "hangs=" not in result_line(stdout)  # slow is not hung: the run went on all along


def result_line(stdout):
    return [text for text in stdout.splitlines() if text.startswith("result: ")][-1]


def test_a_chaos_slow_rank_that_cannot_work_is_refused_before_anything_starts(tmp_path):
    body = training_run()
    body["spec"]["recovery"]["slowRankFactor"] = 0
    done = local(tmp_path, write_run(tmp_path, body), "--chaos-slow-rank", "3")
    assert done.returncode == 2 and "slowRankFactor is 0 (off)" in done.stderr
