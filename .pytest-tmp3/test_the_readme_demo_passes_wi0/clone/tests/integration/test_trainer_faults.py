"""The trainer's fault handling end to end: real torchrun processes (gloo, CPU), real signals, real
storage servers (GCS emulator, moto S3), and faults injected by a model and a dataset from
tests/fault_injection.py, which the trainer imports by classPath from the PYTHONPATH, as it would a
user's own class.

Every run starts the operator's container command (`DEFAULT_COMMAND`: torchrun's agent wrapped
by trainingrun_trainer.launch so the container's exit code keeps the workers' meaning) with
torchrun's options in PET_* variables, as the Kubeflow Training Operator starts it in a pod.

Synchronisation is by log lines, files and process exit only, never by sleeping: the
`FaultyText` dataset pauses a trainer before a chosen item (so at a known step), logs that, and
waits until the test creates a release file; the test acts in between (breaks storage, sends a
signal, kills a worker). The deadlines below only bound how long a broken test can hang.

Besides the container's exit code, the tests read each worker's from torchrun's failure summary
(`exitcode : N` per rank), which says what the trainer itself did.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import yaml

from environments import inherited
from storage_servers import gcs_bucket, gcs_move_is_copy, gcs_server, s3_bucket, s3_server  # noqa: F401
from tiny_runs import tiny_model
from trainingrun_api import contract, exit_codes
from trainingrun_operator import naming, pod_env
from trainingrun_operator.builders import DEFAULT_COMMAND
from trainingrun_trainer import launch
from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore
from trainingrun_trainer.sampling import ResumableSampler

pytestmark = pytest.mark.slow

TESTS_DIR = Path(__file__).resolve().parent.parent
#: Safety bound for one wait on a log line or an exit; never a synchronisation device.
DEADLINE_S = 120.0

MODEL = tiny_model()
BATCH = 8


def dataset(**init_args) -> dict:
    return {
        "classPath": "fault_injection.FaultyText",
        "initArgs": {"numSamples": 4096, "contextLength": 16, **init_args},
    }


def first_item_of_step(step: int, per_step: int = BATCH) -> int:
    """The per-process item count at which a FaultyText pause stops the trainer before `step`."""
    return (step - 1) * per_step + 1


# ------------------------------------------------------------------------------------ processes


class Launched:
    """A torchrun (or single trainer) process group: its merged output is read by a thread so a
    test can wait for lines while the process runs."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.argv = argv
        self.process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def log(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def tail(self, n: int = 400) -> str:
        with self._changed:
            return "".join(self.lines[-n:])

    def wait_for(self, *patterns: str) -> list[str]:
        """Wait until each regex matched a line; returns the first matching line of each."""
        compiled = [re.compile(p) for p in patterns]
        found: list[Optional[str]] = [None] * len(compiled)
        seen = 0
        deadline = time.monotonic() + DEADLINE_S
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    for i, regex in enumerate(compiled):
                        if found[i] is None and regex.search(line):
                            found[i] = line
                seen = len(self.lines)
                if all(f is not None for f in found):
                    return found  # type: ignore[return-value]
                missing = [p for p, f in zip(patterns, found) if f is None]
                if self._eof:
                    raise AssertionError(f"process ended without {missing}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {missing} within {DEADLINE_S:.0f} s:\n{self.tail()}")
                self._changed.wait(left)

    def finish(self, deadline_s: float = DEADLINE_S) -> int:
        """Wait for the exit (bounded) and for the whole output; returns the exit code."""
        try:
            self.process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.argv} did not exit within {deadline_s:.0f} s:\n{self.tail()}") from None
        self._reader.join(timeout=DEADLINE_S)
        return self.process.returncode

    def workers(self) -> dict[int, int]:
        """{local rank: pid} of the worker processes. The launcher forks the built-in trainer's workers
        from its forkserver (a child of the agent), one per local rank in rank order, so they are the
        agent's grandchildren by increasing pid (their /proc environ is the forkserver's, without
        LOCAL_RANK)."""

        def children(pid: int) -> list[int]:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
            return sorted(map(int, out.split()))

        grandchildren = sorted(w for child in children(self.process.pid) for w in children(child))
        return dict(enumerate(grandchildren))

    def kill(self) -> None:
        """SIGKILL the process and its descendants (torchrun starts each worker in a session of
        its own, so killing torchrun's process group would orphan them)."""
        if self.process.poll() is not None:
            return
        descendants, parents = [], [self.process.pid]
        while parents:
            out = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", ",".join(map(str, parents))], capture_output=True, text=True
            ).stdout.split()
            parents = [int(pid) for pid in out]
            descendants += parents
        for pid in [self.process.pid, *descendants]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


@pytest.fixture
def launched():
    """Processes a test started; whatever of them still runs at teardown is killed."""
    started: list[Launched] = []
    yield started
    for proc in started:
        proc.kill()


def rank_line(rank: int, logger: str, message: str, level: str = r"\w+") -> str:
    """Regex of one trainer log line: `<time> rank<r> <LEVEL> <logger>: <message>`."""
    return rf" rank{rank} {level} {re.escape(logger)}: {message}"


def worker_exit_codes(log: str) -> dict[int, int]:
    """{rank: exitcode} from torchrun's failure summary (printed when workers failed)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", log)
    return {int(rank): int(code) for rank, code in found}


def assert_workers_exited(log: str, code: int) -> None:
    """Every worker exited with `code`, or with -15: killed by torchrun's SIGTERM while the Python
    interpreter was finalizing (which takes a second or two), after another worker had exited."""
    codes = worker_exit_codes(log)
    assert code in codes.values() and set(codes.values()) <= {code, -signal.SIGTERM}, codes


def release(pause_dir: Path, item: int) -> None:
    (pause_dir / f"release-{item}").touch()


class Run:
    """One TrainingRun's files below tmp_path: config, checkpoints (file:// unless `uri`), pauses."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        trainer: dict,
        *,
        uri: Optional[str] = None,
        interval: int = 10,
        keep: int = 5,
        endpoint_url: Optional[str] = None,
        env: Optional[dict] = None,
    ):
        self.dir = tmp_path / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pauses = self.dir / "pauses"
        self.pauses.mkdir(exist_ok=True)
        self.served = self.dir / "served"
        self.served.mkdir(exist_ok=True)
        self.uri = uri or f"file://{self.dir}/checkpoints"
        self.trainer = copy.deepcopy(trainer)
        self.checkpoint = {"uri": self.uri, "interval": {"steps": interval}, "keep": keep}
        if endpoint_url:
            self.checkpoint["endpointUrl"] = endpoint_url
        self.env = dict(env or {})
        self.config = self.dir / "config.yaml"
        self.write_config()

    def inject(self, *, pause_at_items: tuple = (), record: bool = False) -> "Run":
        """Configure the FaultyText dataset: pause before these items, record the served indices."""
        args = self.trainer["data"]["dataset"]["initArgs"]
        if pause_at_items:
            args.update(pauseAtItems=list(pause_at_items), pauseDir=str(self.pauses))
        if record:
            args["recordDir"] = str(self.served)
        self.write_config()
        return self

    def write_config(self) -> None:
        self.config.write_text(yaml.safe_dump({"trainer": self.trainer, "checkpoint": self.checkpoint}))

    def environment(self) -> dict[str, str]:
        keep = inherited(
            "TRAININGRUN_", "PET_", "AWS_", "GOOGLE_", "STORAGE_EMULATOR", "FAULT_INJECTION",
            names=("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
        )  # fmt: skip
        path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
        keep.update(
            {
                "TRAININGRUN_CONFIG": str(self.config),
                "TRAININGRUN_NAME": self.dir.name,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": path,
                **self.env,
            }
        )
        return keep

    def start(self, launched: list, nproc: int = 2, max_restarts: int = 0) -> Launched:
        """Start the operator's container command with torchrun's options in PET_* variables, as
        the Kubeflow Training Operator passes them, on one node of `nproc` workers."""
        env = {
            **self.environment(),
            "PET_STANDALONE": "1",
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_MAX_RESTARTS": str(max_restarts),
        }
        proc = Launched(runnable(DEFAULT_COMMAND), env)
        launched.append(proc)
        return proc

    def store(self, **kwargs) -> CheckpointStore:
        return CheckpointStore(self.uri, **kwargs)

    def served_indices(self) -> list[int]:
        out: list[int] = []
        for path in sorted(self.served.glob("served-*.txt")):
            out += [int(x) for x in path.read_text().split()]
        return out


def runnable(command: list[str]) -> list[str]:
    """A container command as this machine runs it: `torchrun` is this Python's
    torch.distributed.run, `python` this Python."""
    program, *args = command
    if program == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *args]
    if program in ("python", "python3"):
        return [sys.executable, *args]
    raise AssertionError(f"do not know how to run the container command {command}")


def losses(log: str, rank: int = 0) -> list[float]:
    return [float(x) for x in re.findall(rf" rank{rank} INFO trainingrun\.trainer: step \d+/\d+ loss (\S+)", log)]


# ------------------------------------------------------------------------------------ 1. exact resume on buckets

# As tests/integration/test_trainer_resume.py: deterministic, accumulation 2, EMA; the data is
# FaultyText (the same items as SyntheticText) so the run can be paused at a known step.
EXACT = {
    "model": MODEL,
    "data": {"dataset": dataset(), "batchSize": BATCH},
    "maxSteps": 30,
    "deterministic": True,
    "logIntervalSteps": 1,
    "gradAccumulationSteps": 2,
    "ema": {"enabled": True},
}


@pytest.fixture(scope="module")
def reference_digest(tmp_path_factory) -> str:
    """Model digest at step 30 of an uninterrupted 2-process run (file://; the bits do not depend on storage)."""
    run = Run(tmp_path_factory.mktemp("reference"), "reference", EXACT)
    started: list[Launched] = []
    try:
        proc = run.start(started)
        assert proc.finish() == 0, proc.tail()
    finally:
        for p in started:
            p.kill()
    return {i.step: i for i in run.store().list()}[30].model_digest


@pytest.fixture(params=["gs", "s3"])
def bucket_run(request, tmp_path):
    """A Run whose checkpoints go to a fresh bucket, with what the trainer process needs to reach it.

    s3://: `checkpoint.endpointUrl` and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (moto's dummies),
    as the operator passes them. gs://: the config has no endpoint for gs (the CRD allows endpointUrl
    with s3 only), so the trainer finds the emulator the way gcsfs does for any GCS client:
    STORAGE_EMULATOR_HOST; with no credentials in the environment, gcsfs falls back to anonymous
    access (NO_GCE_CHECK=true skips google-auth's metadata-server probe). The store renames on gs://
    too (DCP commits `.metadata` by renaming `.metadata.tmp`; the manifest is one PUT), so the
    trainer processes import fault_injection with FAULT_INJECTION_GCS_MOVE_IS_COPY=1, which makes
    gcsfs's move a copy + delete: the emulator answers gcsfs's moveTo with 501 and gcsfs retries it
    for about 33 s per save before falling back to exactly that.
    """
    if request.param == "gs":
        server = request.getfixturevalue("gcs_server")
        bucket = request.getfixturevalue("gcs_bucket")
        env = {
            "STORAGE_EMULATOR_HOST": server.endpoint_url,
            "NO_GCE_CHECK": "true",
            "FAULT_INJECTION_GCS_MOVE_IS_COPY": "1",
        }
        endpoint = None
    else:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        endpoint = server.endpoint_url
    pause_at = first_item_of_step(16, BATCH * 2)
    run = Run(tmp_path, f"on-{request.param}", EXACT, uri=f"{bucket}/runs/exact", endpoint_url=endpoint, env=env)
    run.inject(pause_at_items=(pause_at,))
    run.server = server
    run.pause_at = pause_at
    return run


def test_exact_resume_on_object_storage(bucket_run, reference_digest, launched):
    """A worker SIGKILLed between checkpoints (after step 15, step 10 committed to the bucket); the
    rerun resumes from the bucket at step 10 and ends with the uninterrupted run's model."""
    run = bucket_run
    interrupted = run.start(launched)
    interrupted.wait_for(
        rank_line(0, "fault_injection", f"paused at item {run.pause_at} "),
        rank_line(1, "fault_injection", f"paused at item {run.pause_at} "),
        # in the bucket: persisted behind its commit in memory (or committed there, persisting behind turned off)
        rank_line(0, "trainingrun.checkpoint", "(?:committed|persisted) checkpoint step 10 to " + re.escape(run.uri)),
    )
    os.kill(interrupted.workers()[1], signal.SIGKILL)
    release(run.pauses, run.pause_at)  # the survivor fails in its next collective
    assert interrupted.finish() != 0, interrupted.tail()
    assert "step 16/30" not in interrupted.log

    resumed = run.start(launched)
    assert resumed.finish() == 0, resumed.tail()
    resumed.wait_for(rank_line(0, "trainingrun.session", f"resumed from {re.escape(run.uri)}/step-00000010 at step 10"))
    infos = {i.step: i for i in CheckpointStore(run.uri, **run.server.store_kwargs).list()}
    assert infos[30].valid and infos[30].model_digest == reference_digest


# ------------------------------------------------------------------------------------ 2, 3. preemption

LEARNING = {
    "model": MODEL,
    "data": {"dataset": dataset(), "batchSize": BATCH},
    "optimizer": {"lr": 0.01},
    "maxSteps": 30,
    "logIntervalSteps": 1,
}
STOP_AT = 16  # the step a test stops a run at: the pause holds the trainer before it


def preempt_at(run: Run, proc: Launched, nproc: int, step: int, target: int) -> None:
    """With every rank paused before `step`, SIGTERM `target` (torchrun, as the kubelet does to the
    container's PID 1, or one worker), wait until it reached the workers, then let them go on."""
    item = first_item_of_step(step)
    proc.wait_for(*(rank_line(r, "fault_injection", f"paused at item {item} ") for r in range(nproc)))
    os.kill(target, signal.SIGTERM)
    signalled = (
        range(nproc) if target == proc.process.pid else [rank for rank, pid in proc.workers().items() if pid == target]
    )
    proc.wait_for(*(rank_line(r, "trainingrun.session", "SIGTERM received") for r in signalled))
    release(run.pauses, item)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_preempted_run_resumes_at_another_world_size(tmp_path, launched, before, after):
    """Preempted at step 16 with one world size, resumed with another: it continues from step 16,
    reaches maxSteps, learns, and sees every sample of the epoch's order exactly once."""
    run = Run(tmp_path, "elastic", LEARNING).inject(pause_at_items=(first_item_of_step(STOP_AT),), record=True)
    first = run.start(launched, nproc=before)
    preempt_at(run, first, before, STOP_AT, first.process.pid)
    assert first.finish() == exit_codes.PREEMPTED, first.tail()
    first.wait_for(rank_line(0, "trainingrun.checkpoint", f"committed checkpoint step {STOP_AT} "))

    second = run.start(launched, nproc=after)
    assert second.finish() == 0, second.tail()
    second.wait_for(
        rank_line(0, "trainingrun.session", f"resumed from {re.escape(run.uri)}/step-{STOP_AT:08d} at step {STOP_AT}"),
        *(rank_line(r, "trainingrun.trainer", "step 30/30 ") for r in range(after)),
    )
    assert not re.search(rf"step {STOP_AT}/30 ", second.log), "the resumed run repeated a step"
    start, end = losses(first.log)[:5], losses(second.log)[-5:]
    assert sum(end) / 5 < sum(start) / 5 - 0.5, (start, end)  # it learns: about 4.85 -> 3.8 nats

    served = run.served_indices()
    expected = STOP_AT * BATCH * before + (30 - STOP_AT) * BATCH * after
    assert len(served) == expected and len(set(served)) == expected, "a sample was served twice"
    order = ResumableSampler(4096, rank=0, world_size=1, seed=0).permutation(0)
    assert set(served) == set(order[:expected]), "a sample of the epoch's order was skipped"


def test_sigterm_to_the_container_checkpoints_and_the_rerun_resumes_there(tmp_path, launched):
    """SIGTERM to the container's PID 1 (the kubelet signals nothing else): every rank finishes its
    step and writes an emergency checkpoint at it, and the container exits 143 (retryable; plain
    torchrun would exit 1, permanent); the next attempt resumes from exactly that step."""
    run = Run(tmp_path, "preempted", LEARNING).inject(pause_at_items=(first_item_of_step(STOP_AT),))
    first = run.start(launched)
    preempt_at(run, first, 2, STOP_AT, first.process.pid)
    assert first.finish() == exit_codes.PREEMPTED, first.tail()
    first.wait_for(
        *(
            rank_line(r, "trainingrun.trainer", f"SIGTERM: writing an emergency checkpoint at step {STOP_AT}$")
            for r in range(2)
        ),
        rank_line(0, "trainingrun.checkpoint", f"committed checkpoint step {STOP_AT} "),
    )
    assert max(i.step for i in run.store().list() if i.valid) == STOP_AT

    rerun = run.start(launched)
    assert rerun.finish() == 0, rerun.tail()
    rerun.wait_for(
        rank_line(0, "trainingrun.session", f"resumed from {re.escape(run.uri)}/step-{STOP_AT:08d} at step {STOP_AT}")
    )
    assert f"step {STOP_AT + 1}/30 " in rerun.log and f"step {STOP_AT}/30 " not in rerun.log


def test_an_in_place_restart_of_a_later_attempt_resumes_from_the_newest_checkpoint(tmp_path, launched):
    """Attempt 2 starts with the operator's resume point (step 10) in its environment. torchrun restarts its
    worker group in place after a worker dies (PET_MAX_RESTARTS, as Kubeflow's pod keeps its env): the new
    workers resume from step 20, committed since, not from the attempt's starting point, and read it from node
    memory (the attempt's /dev/shm copy); the attempt itself, a new pod, read its start from storage."""
    pause = first_item_of_step(STOP_AT)
    run = Run(tmp_path, "in-place", LEARNING).inject(pause_at_items=(pause,))
    first = run.start(launched)
    first.wait_for(
        rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 10 "),
        *(rank_line(r, "fault_injection", f"paused at item {pause} ") for r in range(2)),
    )
    first.kill()  # attempt 1's pod is gone; its last report was step 10

    floor = f"{run.uri}/step-00000010"
    run.env.update({contract.ATTEMPT: "2", contract.RESUME_FROM: floor})
    second = run.start(launched, max_restarts=1)
    # The attempt starts from the resume point, trains steps 11-25 (its workers count items from their start)
    # and commits step 20; then worker 1 dies and torchrun starts a new worker group with the same environment.
    second.wait_for(
        rank_line(
            0,
            "trainingrun.session",
            rf"resumed from {re.escape(floor)} at step 10 in [\d.]+ s, "
            "reading storage",
        ),
        rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 20 "),
        *(rank_line(r, "fault_injection", f"paused at item {pause} ") for r in range(2)),
    )
    os.kill(second.workers()[1], signal.SIGKILL)
    release(run.pauses, pause)
    assert second.finish() == 0, second.tail()
    newest = re.search(
        rank_line(
            0,
            "trainingrun.session",
            rf"resumed from {re.escape(run.uri)}/step-00000020 at step 20 "
            r"in [\d.]+ s, reading node memory",
        ),
        second.log,
    )
    assert newest, second.tail()
    restarted = second.log[newest.end() :]
    assert " step 30/30 " in restarted and " step 20/30 " not in restarted and " step 11/30 " not in restarted


def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path, launched):
    run = Run(tmp_path, "one-worker", LEARNING).inject(pause_at_items=(first_item_of_step(STOP_AT),))
    proc = run.start(launched)
    proc.wait_for(*(rank_line(r, "fault_injection", "paused at item") for r in range(2)))
    rank1 = proc.workers()[1]
    preempt_at(run, proc, 2, STOP_AT, rank1)
    assert proc.finish() == exit_codes.PREEMPTED, proc.tail()
    proc.wait_for(
        *(
            rank_line(r, "trainingrun.trainer", f"SIGTERM: writing an emergency checkpoint at step {STOP_AT}$")
            for r in range(2)
        ),
        rank_line(0, "trainingrun.checkpoint", f"committed checkpoint step {STOP_AT} "),
    )
    # Rank 0 never got the signal before it stopped: it stopped because rank 1 did.
    rank0 = [line for line in proc.lines if " rank0 " in line]
    emergency = next(i for i, line in enumerate(rank0) if "emergency checkpoint" in line)
    assert not any("SIGTERM received" in line for line in rank0[:emergency])
    assert_workers_exited(proc.log, exit_codes.PREEMPTED)
    assert {i.step for i in run.store().list() if i.valid} == {10, STOP_AT}


# ------------------------------------------------------------------------------------ 4. storage outage


class Outage:
    """A file:// checkpoint volume that goes away (the path is replaced by a plain file, so even root cannot write
    there) and comes back, with the run's ranks paused before each of `pause_before` steps."""

    def __init__(self, run: Run, pause_before: tuple[int, ...]):
        self.items = {step: first_item_of_step(step) for step in pause_before}
        run.inject(pause_at_items=tuple(self.items.values()))
        self.base, self._away = run.dir / "checkpoints", run.dir / "checkpoints.away"

    def down(self) -> None:
        self.base.rename(self._away)
        self.base.write_text("the checkpoint volume is gone\n")

    def back(self) -> None:
        self.base.unlink()
        self._away.rename(self.base)

    def paused_before(self, proc: Launched, step: int, *also: str) -> None:
        paused = (rank_line(r, "fault_injection", f"paused at item {self.items[step]} ") for r in range(2))
        proc.wait_for(*paused, *also)


def test_storage_outage_during_saves(tmp_path, launched):
    """file:// checkpoints, committed to storage (not persisted behind), on a volume that goes away (the path is
    replaced by a plain file, so even root cannot write there) for the save at step 20 and again for the final save
    at step 40.
    Training goes on past the failed periodic save and the next save commits; the failed final save
    ends the attempt with the retryable code; the next attempt skips a partial and a corrupt newer
    checkpoint, resumes from the last committed one and finishes."""
    run = Run(tmp_path, "outage", {**LEARNING, "maxSteps": 40})
    run.checkpoint["persistBehind"] = False  # saves that commit to storage (as with several pods)
    outage = Outage(run, pause_before=(13, 25, 40))
    items, base, storage_down, storage_back = outage.items, outage.base, outage.down, outage.back
    paused_before = outage.paused_before

    proc = run.start(launched)
    paused_before(proc, 13, rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 10 "))
    storage_down()
    release(run.pauses, items[13])
    # Step 20's save fails in the background on both ranks while they train on to step 25.
    paused_before(
        proc,
        25,
        *(rank_line(r, "trainingrun.checkpoint", "checkpoint step 20: .*could not write", "ERROR") for r in range(2)),
    )
    storage_back()
    release(run.pauses, items[25])
    paused_before(proc, 40, rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 30 "))
    storage_down()
    release(run.pauses, items[40])
    code = proc.finish()
    storage_back()
    proc.wait_for(
        *(rank_line(r, "trainingrun.trainer", "step 40/40 ") for r in range(2)),
        rank_line(0, "trainingrun.checkpoint", "checkpoint step 40: .*could not write", "ERROR"),
    )
    assert_workers_exited(proc.log, exit_codes.RETRYABLE)
    assert code == exit_codes.RETRYABLE and not exit_codes.is_permanent(code), proc.tail()
    assert [(i.step, i.valid) for i in run.store().list()] == [(30, True), (10, True)]

    # Newer than the last good checkpoint: a save that died before its manifest, and a committed
    # checkpoint whose data was corrupted afterwards. Neither may be resumed from.
    partial, corrupt = base / "step-00000035", base / "step-00000038"
    shutil.copytree(base / "step-00000030", partial)
    (partial / MANIFEST_NAME).unlink()
    shutil.copytree(base / "step-00000030", corrupt)
    manifest = json.loads((corrupt / MANIFEST_NAME).read_text())
    (corrupt / MANIFEST_NAME).write_text(json.dumps({**manifest, "step": 38}))
    data = next(corrupt.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))

    rerun = run.start(launched)
    assert rerun.finish() == 0, rerun.tail()
    uri = re.escape(run.uri)
    rerun.wait_for(
        rank_line(0, "trainingrun.checkpoint", f"skipping checkpoint {uri}/step-00000038: xxh3_128 mismatch"),
        rank_line(0, "trainingrun.checkpoint", f"skipping checkpoint {uri}/step-00000035: no manifest"),
        rank_line(0, "trainingrun.session", f"resumed from {uri}/step-00000030 at step 30"),
        rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 40 "),
    )
    assert max(i.step for i in run.store().list() if i.valid) == 40


def test_storage_outage_while_persisting_behind(tmp_path, launched):
    """Persisting behind (the default in one pod), the same outage holds neither training nor its checkpoints: step 20
    commits in memory and only its copy to storage fails (logged; the next checkpoint tries again), step 30 reaches
    storage once it is back; the final save at step 40 commits in memory but cannot reach storage, so the attempt ends
    with the retryable code; a restart inside the pod resumes from step 40 in memory, which storage never got, and
    finishes with it in storage."""
    run = Run(tmp_path, "outage-behind", {**LEARNING, "maxSteps": 40})
    outage = Outage(run, pause_before=(13, 25, 40))
    items, storage_down, storage_back = outage.items, outage.down, outage.back
    paused_before = outage.paused_before

    not_copied = "checkpoint step {} \\(committed in memory\\) could not be copied"
    proc = run.start(launched)
    paused_before(proc, 13, rank_line(0, "trainingrun.checkpoint", "persisted checkpoint step 10 to "))
    storage_down()
    release(run.pauses, items[13])
    paused_before(
        proc,
        25,
        rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 20 in memory"),
        rank_line(0, "trainingrun.checkpoint", not_copied.format(20), "ERROR"),
    )
    storage_back()
    release(run.pauses, items[25])
    paused_before(proc, 40, rank_line(0, "trainingrun.checkpoint", "persisted checkpoint step 30 to "))
    storage_down()
    release(run.pauses, items[40])
    code = proc.finish()
    storage_back()
    proc.wait_for(
        rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 40 in memory"),
        rank_line(0, "trainingrun.checkpoint", not_copied.format(40), "ERROR"),
        rank_line(0, "trainingrun.trainer", "the final checkpoint at step 40 is not in storage", "ERROR"),
    )
    assert "could not write" not in proc.log  # no save failed
    assert_workers_exited(proc.log, exit_codes.RETRYABLE)
    assert code == exit_codes.RETRYABLE, proc.tail()
    assert [(i.step, i.valid) for i in run.store().list()] == [(30, True), (10, True)]

    rerun = run.start(launched)  # the same attempt, in the same pod: its memory holds step 40
    assert rerun.finish() == 0, rerun.tail()
    rerun.wait_for(
        rank_line(
            0,
            "trainingrun.session",
            f"resumed from {re.escape(run.uri)}/step-00000040 at step 40 .*reading node memory",
        )
    )
    assert max(i.step for i in run.store().list() if i.valid) == 40


# ------------------------------------------------------------------------------------ 5. non-finite losses


def test_non_finite_losses_are_skipped_then_rolled_back_then_abort(tmp_path, launched):
    """NaN losses on rank 0 only (its gradients stay finite, so nothing else tells rank 1): every
    rank must still take the same decision at the same step.

    Forward calls -> steps (checkpoints every 5 steps, 3 in a row roll back, 2 rollbacks allowed):
    call 5 -> step 5 skipped; calls 12-14 -> steps 12, 13 skipped, 14 rolls back to step 10 (LR x0.5);
    calls 15-24 -> steps 11-20 (checkpoints 15, 20 hold the lowered LR); calls 25-27 -> steps 21-23,
    roll back to step 20 (LR x0.25 of the original, not x0.125); calls 33-35 -> steps 26-28: abort.
    """
    trainer = {
        **LEARNING,
        "model": {
            "classPath": "fault_injection.NaNCharTransformer",
            "initArgs": {"nanCalls": [5, 12, 13, 14, 25, 26, 27, 33, 34, 35], "nanRanks": [0]},
        },
        "optimizer": {"lr": 0.001},
        "schedule": {"name": "constant"},
        "maxSteps": 60,
        "health": {"maxConsecutiveNonFinite": 3, "maxRollbacks": 2, "rollbackLrScale": 0.5},
    }
    run = Run(tmp_path, "nan", trainer, interval=5)
    proc = run.start(launched)
    code = proc.finish()
    log = proc.log
    for rank in range(2):
        proc.wait_for(
            rank_line(rank, "trainingrun.trainer", "skipped step 5: non-finite loss at step 5$", "WARNING"),
            rank_line(rank, "trainingrun.trainer", r"rolled back to step 10 \(non-finite loss at step 14\)"),
            rank_line(rank, "trainingrun.trainer", r"rolled back to step 20 \(non-finite loss at step 23\)"),
            rank_line(
                rank,
                "trainingrun.trainer",
                r"training diverged: non-finite loss at step 28; .*"
                r"spec\.trainer\.health\.maxRollbacks=2",
                "ERROR",
            ),
        )
        steps = re.findall(rf" rank{rank} INFO trainingrun\.trainer: step (\d+)/60 loss (\S+) .* lr (\S+) ", log)
        # Each completed step as logged, in order (a step that rolls back or aborts is not logged).
        assert [int(s) for s, _, _ in steps] == [*range(1, 14), *range(11, 23), *range(21, 28)], steps
        lrs = [float(lr) for _, _, lr in steps]
        assert lrs == [0.001] * 13 + [0.0005] * 12 + [0.00025] * 7, lrs
    assert_workers_exited(log, exit_codes.DIVERGED)
    assert code == exit_codes.DIVERGED and exit_codes.is_permanent(code), proc.tail()
    assert "step 29/60" not in log


# ------------------------------------------------------------------------------------ 6. invalid configs


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"model": {"classPath": "trainingrun_trainer.models.CharTransformr"}},
            "spec.trainer.model.classPath: module 'trainingrun_trainer.models' has no class 'CharTransformr'; "
            "did you mean 'CharTransformer'?",
        ),
        (
            {"model": {"classPath": "fault_injection.NaNCharTransformer", "initArgs": {"nanCals": [3]}}},
            "spec.trainer.model.initArgs: NaNCharTransformer() got an unexpected keyword argument 'nanCals'; "
            "accepted: nanCalls, nanRanks, vocabSize, dim, layers, heads, contextLength; did you mean 'nanCalls'?",
        ),
        ({"precision": "16-mixed"}, "spec.trainer.precision: 16-mixed needs a CUDA GPU"),
    ],
    ids=["unknown-class", "unknown-init-arg", "fp16-on-cpu"],
)
def test_invalid_config_fails_before_any_process_group(tmp_path, launched, change, message):
    """Rank 0 of a 2-process world started alone: a trainer that reached init_process_group would
    wait there for rank 1 (gloo's default timeout is 30 minutes) and never exit on its own. It must
    exit at once with the permanent config-error code and a message naming the field."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = Run(tmp_path, "invalid", {**LEARNING, **change})
    env = {
        **run.environment(),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    proc = Launched([sys.executable, "-m", "trainingrun_trainer"], env)
    launched.append(proc)
    assert proc.finish(deadline_s=60) == exit_codes.CONFIG_ERROR, proc.tail()
    assert message in proc.log and "Traceback" not in proc.log
    assert not (run.dir / "checkpoints").exists()


# ------------------------------------------------------------------------------------ 7. pods of a multi-pod run

# Each "pod" is one launcher with one worker, joined over c10d rendezvous as the Kubeflow Training
# Operator starts elastic workers (PET_* variables), with the env the operator renders for a multi-pod run.
POD_RUN = {**EXACT, "maxSteps": 30}
MAX_RESTARTS = 3
#: The run's rendezvous Service, as worker-0 sees the endpoint: a name that names no machine, so torch's guess
#: (does the endpoint name this host?) says no, and only TRAININGRUN_RENDEZVOUS_HOST_POD makes worker-0 host.
SERVICE_HOST = "demo-rendezvous.invalid"
#: The other pods reach the store at 127.0.0.1, standing in for the Service's address; every launcher here is on
#: 127.0.0.1, which torch would guess is theirs to host, so they are told they are not (on a cluster the
#: Service name matches no pod). A short store timeout for "never comes back".
NOT_THE_HOST = {"PET_RDZV_CONF": "is_host=false,read_timeout=5"}


def start_pod(run: Run, launched: list, rdzv_port: int, index: int) -> Launched:
    """Pod `index` of the run's attempt 1 (worker-0 hosts the rendezvous store)."""
    host_pod = naming.rendezvous_host_pod(run.dir.name, 1)
    env = {
        **run.environment(),
        **pod_env.RENDEZVOUS_ENV,
        "PET_NNODES": "2:2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"{SERVICE_HOST if index == 0 else '127.0.0.1'}:{rdzv_port}",
        "PET_RDZV_ID": run.dir.name,
        "PET_MAX_RESTARTS": str(MAX_RESTARTS),
        contract.POD_NAME: f"{run.dir.name}-a1-worker-{index}",
        contract.POD_IP: "127.0.0.1",
        contract.RENDEZVOUS_HOST_POD: host_pod,
        **(NOT_THE_HOST if index else {}),
    }
    proc = Launched(runnable(DEFAULT_COMMAND), env)
    launched.append(proc)
    return proc


def wait_listening(port: int, proc: Launched) -> None:
    """Until the rendezvous store accepts connections (the launcher logs nothing while it waits)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.process.poll() is None, f"the launcher exited:\n{proc.tail()}"
            assert time.monotonic() < deadline, f"nothing listens on {port}:\n{proc.tail()}"
            time.sleep(0.05)  # polling the port, not a guess at how long it takes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_pods_paused(run: Run, launched: list, pause_at: int) -> tuple[Launched, Launched, int]:
    """worker-0 (the rendezvous host) and worker-1, both trained to the pause with step 10 committed."""
    port = free_port()
    host = start_pod(run, launched, port, 0)
    wait_listening(port, host)  # its store is up before the second pod looks for it
    other = start_pod(run, launched, port, 1)
    for pod in (host, other):
        pod.wait_for(rank_line(r"\d", "fault_injection", f"paused at item {pause_at} "))
    host.wait_for(rank_line(0, "trainingrun.checkpoint", "committed checkpoint step 10 "))
    return host, other, port


REJOINING = "rejoining in this container"


def test_the_survivor_of_the_rendezvous_host_rejoins_its_replacement_without_restarting(
    tmp_path, launched, reference_digest
):
    """worker-0 deleted (SIGKILL to all its processes) and started again, as Kubeflow does: the other pod's
    worker fails in its next collective, its agent cannot reach the lost store and starts again in the
    same container, joins the replacement's store, and both resume from step 10 to the uninterrupted
    run's model. (Exiting instead made Kubeflow replace the survivor's pod too: ~2 s more.)"""
    pause_at = first_item_of_step(16, BATCH * 2)
    run = Run(tmp_path, "host-replaced", POD_RUN).inject(pause_at_items=(pause_at,))
    host, survivor, port = two_pods_paused(run, launched, pause_at)
    host.kill()
    release(run.pauses, pause_at)
    survivor.wait_for(re.escape(REJOINING))
    replacement = start_pod(run, launched, port, 0)
    assert replacement.finish() == 0, replacement.tail()
    assert survivor.finish() == 0, survivor.tail()
    assert re.search(f"resumed from {re.escape(run.uri)}/step-00000010 at step 10", survivor.log + replacement.log)
    replacement_steps = [
        int(s) for s in re.findall(r" rank\d INFO trainingrun\.trainer: step (\d+)/30 ", replacement.log)
    ]
    assert replacement_steps == list(range(11, 31)), replacement_steps
    infos = {i.step: i for i in run.store().list()}
    assert infos[30].valid and infos[30].model_digest == reference_digest


def test_when_the_rendezvous_host_does_not_come_back_the_survivor_exits_retryable(tmp_path, launched):
    """No replacement within the store's read_timeout, REJOINS times: the container exits with the
    retryable code, so Kubeflow restarts it, instead of torchrun's exit 1 (permanent)."""
    pause_at = first_item_of_step(16, BATCH * 2)
    run = Run(tmp_path, "host-deleted", POD_RUN).inject(pause_at_items=(pause_at,))
    host, survivor, _ = two_pods_paused(run, launched, pause_at)
    host.kill()
    release(run.pauses, pause_at)
    code = survivor.finish()
    assert code == exit_codes.RETRYABLE, survivor.tail()
    assert survivor.log.count(REJOINING) == launch.REJOINS
    assert "trainingrun launch: rendezvous lost" in survivor.log


def test_a_replaced_pod_rejoins_and_training_resumes_from_the_last_checkpoint(tmp_path, launched, reference_digest):
    """worker-1 deleted and started again (as Kubeflow does with a deleted pod): the survivor restarts its
    worker in place, both rejoin a new rendezvous round, resume from step 10 and end with the model
    of an uninterrupted run. Without RENDEZVOUS_ENV torch 2.13's survivor waits for a store address
    that is never published and fails after its timeout."""
    pause_at = first_item_of_step(16, BATCH * 2)
    run = Run(tmp_path, "worker-replaced", POD_RUN).inject(pause_at_items=(pause_at,))
    host, other, port = two_pods_paused(run, launched, pause_at)
    other.kill()
    release(run.pauses, pause_at)
    replacement = start_pod(run, launched, port, 1)
    assert replacement.finish() == 0, replacement.tail()
    assert host.finish() == 0, host.tail()
    host.wait_for(rank_line(0, "trainingrun.session", f"resumed from {re.escape(run.uri)}/step-00000010 at step 10"))
    replacement_steps = [
        int(s) for s in re.findall(r" rank1 INFO trainingrun\.trainer: step (\d+)/30 ", replacement.log)
    ]
    assert replacement_steps == list(range(11, 31)), replacement_steps
    infos = {i.step: i for i in run.store().list()}
    assert infos[30].valid and infos[30].model_digest == reference_digest


def test_a_pod_waiting_in_rendezvous_stops_at_once_on_sigterm_as_pid_1(tmp_path, launched):
    """The launcher as PID 1 of its own PID namespace, as in a container: the kernel delivers SIGTERM to
    PID 1 only when it has a handler, and torch installs its handler only once workers run. A pod
    deleted while it waits for its peers must stop at once (143), not after the grace period."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare --pid (root or user namespaces) to run the launcher as PID 1")
    run = Run(tmp_path, "alone", POD_RUN)
    port = free_port()
    env = {
        **run.environment(),
        **pod_env.RENDEZVOUS_ENV,
        "PET_NNODES": "2:2",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_ID": "alone",
    }
    proc = Launched(["unshare", "--pid", "--fork", "--kill-child", *runnable(DEFAULT_COMMAND)], env)
    launched.append(proc)
    wait_listening(port, proc)
    pid_1 = int(
        subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(proc.process.pid)], capture_output=True, text=True
        ).stdout.split()[0]
    )
    os.kill(pid_1, signal.SIGTERM)
    assert proc.finish(deadline_s=30) == exit_codes.PREEMPTED, proc.tail()
    assert "trainingrun launch: stopped by SIGTERM" in proc.log
