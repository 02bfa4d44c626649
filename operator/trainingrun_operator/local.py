"""`trainingrun local FILE`: run a TrainingRun on this machine, supervised the way the operator would.

Each attempt is the same launcher a pod runs (`python -m trainingrun_trainer.launch`, torchrun's
elastic agent) with the same environment contract. The trainer reports progress and committed
checkpoints to a small status endpoint served here, exactly as it patches `status` in a cluster,
so the runner sees what the operator would: when an attempt dies it is classified (permanent,
preemption, failure), charged to the run's recovery budget, and a new attempt resumes from the last
good checkpoint after the backoff. Fault injection (`--chaos-kill-step`, `--chaos-kill-every`)
SIGKILLs a worker to show that this works.
"""
from __future__ import annotations

import hmac
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

import yaml

from trainingrun_trainer import contract, exit_codes
from trainingrun_trainer.config import RunConfig

from . import api, builders, recovery, validation

DEFAULT_RUNS_DIR = "runs"


class LocalRunError(Exception):
    """A problem found before anything started; the message says what to do."""


class LocalOptionError(LocalRunError):
    """A command-line option that cannot work (a usage error, exit code 2)."""


@dataclass
class LocalOptions:
    nproc: Optional[int] = None  #: processes (default: spec.nprocPerNode)
    checkpoint_uri: Optional[str] = None  #: default: file://./runs/<name>/checkpoints
    max_steps: Optional[int] = None  #: override spec.trainer.maxSteps
    chaos_kill_steps: list[int] = field(default_factory=list)  #: SIGKILL a worker when the run reaches each
    chaos_kill_every: Optional[float] = None  #: SIGKILL a random worker every N seconds
    metrics_port: Optional[int] = None  #: TRAININGRUN_METRICS_PORT for the trainer
    env_file: str = ".env"  #: where secrets come from when not in the environment
    runs_dir: str = DEFAULT_RUNS_DIR
    chaos_seed: int = 0


# ---------------------------------------------------------------- loading and secrets


def load_run(path: str, options: LocalOptions) -> api.TrainingRun:
    """Parse the file the way `validate` does, filling in what a laptop run may leave out."""
    documents = validation.load_file(path)
    if len(documents) != 1:
        raise validation.InvalidTrainingRun(
            [validation.Problem("", f"{path} holds {len(documents)} documents; `trainingrun local` runs one TrainingRun")]
        )
    document = documents[0]
    if isinstance(document, dict) and isinstance(document.get("spec"), dict):
        spec = document["spec"]
        name = str((document.get("metadata") or {}).get("name", "run"))
        checkpoint = spec.setdefault("checkpoint", {})
        if isinstance(checkpoint, dict):
            uri = options.checkpoint_uri or checkpoint.get("uri") or f"file://{Path(options.runs_dir).resolve()}/{name}/checkpoints"
            checkpoint["uri"] = uri
            if isinstance(document.get("metadata"), dict):
                # Rerunning the command goes on with the same run (its goodput counts both invocations).
                document["metadata"].setdefault("uid", RunLedger.load(Path(options.runs_dir) / name, str(uri)).uid)
        # This machine is one node: a cluster file's several pods become one here, so a local file:// URI is fine.
        spec["replicas"] = {"min": 1}
        if options.max_steps is not None:
            trainer = spec.setdefault("trainer", {})
            if isinstance(trainer, dict):
                trainer["maxSteps"] = options.max_steps
    return validation.parse(document)


def check_options(run: api.TrainingRun, options: LocalOptions) -> None:
    """Options that could never do what they ask, refused before any process starts."""
    last = run.spec.trainer.max_steps
    late = sorted(step for step in options.chaos_kill_steps if step > last)
    if late:
        raise LocalOptionError(f"--chaos-kill-step {late[0]} is past the run's last step ({last}, "
                               f"spec.trainer.maxSteps or --max-steps): it would never fire; pick a step up to {last}")
    if options.metrics_port and not port_is_free(options.metrics_port):
        raise LocalOptionError(f"--metrics-port {options.metrics_port} is in use on this machine: pick a free port, "
                               "or leave --metrics-port out (the run then serves no metrics)")


def port_is_free(port: int) -> bool:
    """Whether the trainer's metrics server could listen on `port` (it binds every interface, reusing TIME_WAIT)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines (# comments, optional quotes, optional `export`); a missing file is empty."""
    values: dict[str, str] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return values
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        if "=" not in line:
            raise LocalRunError(f"{path}:{number}: expected KEY=VALUE")  # never echo the line: it may hold a secret
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def secret_variables(spec: api.TrainingRunSpec) -> list[tuple[str, str]]:
    """(variable, what it stands for) for every secret the run references."""
    wanted = [(e.name, f"secrets.env {e.secret_name}/{e.key}") for e in spec.secrets.env]
    if spec.secrets.gcs_key_file:
        ref = spec.secrets.gcs_key_file
        wanted.append(("GOOGLE_APPLICATION_CREDENTIALS", f"path of the key file for secrets.gcsKeyFile {ref.secret_name}/{ref.key}"))
    s3 = spec.secrets.s3_credentials
    if s3:
        wanted += [("AWS_ACCESS_KEY_ID", f"secrets.s3Credentials {s3.secret_name}/{s3.access_key_id_key}"),
                   ("AWS_SECRET_ACCESS_KEY", f"secrets.s3Credentials {s3.secret_name}/{s3.secret_access_key_key}")]
        if s3.session_token_key:
            wanted.append(("AWS_SESSION_TOKEN", f"secrets.s3Credentials {s3.secret_name}/{s3.session_token_key}"))
    return wanted


def resolve_secrets(spec: api.TrainingRunSpec, environ: dict[str, str], env_file: str) -> dict[str, str]:
    """Values for the referenced secrets from the environment or the .env file; names only in errors."""
    from_file = read_env_file(env_file)
    values, missing = {}, []
    for variable, meaning in secret_variables(spec):
        value = environ.get(variable, from_file.get(variable))
        if value:
            values[variable] = value
        else:
            missing.append(f"{variable} ({meaning})")
    if missing:
        raise LocalRunError(
            "missing secrets: " + ", ".join(missing)
            + f"; set them in the environment or in {env_file} (see .env.example)"
        )
    return values


@dataclass
class RunLedger:
    """What one local run keeps between invocations of `trainingrun local` (runs/<name>/run.json): its uid, so a
    rerun resumes as the same run, and the wall time spent so far, for goodput over every invocation. The cluster
    has both in the TrainingRun itself (metadata.uid, status.startTime). A new checkpoint URI is a new run."""

    path: Path
    uid: str
    checkpoint_uri: str
    wall_seconds: float = 0.0  #: of the earlier invocations

    @classmethod
    def load(cls, run_dir: Path, checkpoint_uri: str, uid: Optional[str] = None) -> "RunLedger":
        """The saved one for this checkpoint URI, else a new one (with `uid`, else a fresh uid), not saved yet."""
        path = run_dir / "run.json"
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("checkpointUri") == checkpoint_uri and isinstance(saved.get("uid"), str):
                return cls(path, saved["uid"], checkpoint_uri, float(saved.get("wallSeconds") or 0.0))
        except (OSError, ValueError, TypeError):
            pass  # none yet, or unreadable: a new run
        return cls(path, uid or str(uuid.uuid4()), checkpoint_uri)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"uid": self.uid, "checkpointUri": self.checkpoint_uri,
                                         "wallSeconds": round(self.wall_seconds, 3)}), encoding="utf-8")


# ---------------------------------------------------------------- the status endpoint


class StatusServer:
    """The operator's report endpoint on 127.0.0.1 for one local run: the same protocol (contract.Report,
    a bearer token read from a file at each report), the same checks, and the status it keeps."""

    def __init__(self, run: api.TrainingRun, token_file: Path) -> None:
        self.status: dict[str, Any] = {}
        self.attempt = 0  #: reports of other attempts are refused, as the operator does
        self.reports = 0  #: reports taken so far
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600)
        token_file.write_text(secrets.token_urlsafe(32))
        self.token_file = token_file
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != contract.REPORT_PATH:
                    return self._answer(404, "no such endpoint")
                if not hmac.compare_digest(self.headers.get("Authorization", ""),
                                           f"Bearer {server.token_file.read_text()}"):
                    return self._answer(401, "a bearer token is required")
                if length > contract.MAX_REPORT_BYTES:
                    return self._answer(413, "report too large")
                try:
                    report = contract.Report.from_json(self.rfile.read(length))
                except contract.ReportError as error:
                    return self._answer(400, str(error))
                meta = run.metadata
                refusal = report.refusal(meta.namespace, meta.name, meta.uid or "", server.attempt,
                                         run.spec.checkpoint.uri)
                if refusal:
                    return self._answer(403, refusal)
                with server.changed:
                    server.status.update(report.status_fields())
                    server.reports += 1
                    server.changed.notify_all()
                self._answer(200, "ok")

            def _answer(self, code: int, message: str) -> None:
                body = json.dumps({"message": message}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{contract.REPORT_PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="local-status", daemon=True)
        self.thread.start()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.status))

    def report_count(self) -> int:
        with self.lock:
            return self.reports

    def new_attempt(self, number: int) -> None:
        """Reports of earlier attempts are refused from now on, and the previous attempt's step is not this one's."""
        with self.lock:
            self.attempt = number
            self.status.pop("progress", None)

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------- processes


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return sorted(children)


def worker_pids(agent_pid: int) -> list[int]:
    """The training processes of an attempt: the launcher forks them from its forkserver, a child of the agent."""
    return [worker for child in child_pids(agent_pid) for worker in child_pids(child)]


class LogFollower:
    """The complete lines appended to a log file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


def _end_session(launcher: subprocess.Popen) -> None:
    """Kill what is left of an attempt's processes once its launcher has exited: they share its process group
    (start_new_session), and the forkserver or a worker would otherwise outlive `trainingrun local`."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass




#: Rank 0 says one of these when a worker group starts training (each attempt, each in-place restart).
GROUP_STARTED = re.compile(r"(?:resumed from (\S+) at step (\d+)|no checkpoint to resume from)")
CHAOS_KILLED = re.compile(r"chaos: SIGKILL worker rank (\d+) at step (\d+)")


@dataclass
class WorkerGroup:
    """One start of the training processes: a new attempt, or torchrun restarting the group in place."""

    attempt: int
    resumed_step: int = 0
    last_step: int = 0  #: the furthest step it computed: what a crash throws away back to the next resume
    reports_before: int = 0  #: reports the status endpoint had taken when the group started; later ones are its own
    resumed: bool = False  #: from a checkpoint, not from step 0


@dataclass
class Attempt:
    """One launcher process (one PyTorchJob in a cluster); torchrun may restart its worker group in place."""

    number: int
    code: Optional[int] = None
    log_path: Optional[Path] = None

    def trainer_message(self) -> str:
        """The lines where the trainer said why it stopped."""
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        said = [l for l in lines if l.startswith("trainingrun-trainer:") or " ERROR trainingrun" in l]
        return "\n".join(dict.fromkeys(said))  # each once, in order


#: Signals that stop a local run as a pod deletion would (emergency checkpoint, workers gone), by how they are named.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@dataclass
class Summary:
    steps: int
    final_loss: Optional[float]
    attempts: int  #: launcher attempts, as the cluster's status.attempt counts PyTorchJobs
    restarts_in_place: int  #: worker groups torchrun restarted within an attempt
    lost_steps: int
    goodput: float
    wall_seconds: float
    outcome: str
    message: str = ""
    stop_signal: Optional[int] = None  #: the signal that interrupted the run
    chaos_notes: list[str] = field(default_factory=list)  #: fault injection asked for that never happened

    @property
    def exit_code(self) -> int:
        """0 succeeded, 128 + the signal when interrupted (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 1 failed."""
        if self.outcome == "succeeded":
            return 0
        return 128 + self.stop_signal if self.outcome == "interrupted" and self.stop_signal else 1

    def result_line(self) -> str:
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "nan"
        return (f"result: steps={self.steps} final_loss={loss} attempts={self.attempts} "
                f"restarts_in_place={self.restarts_in_place} lost_steps={self.lost_steps} goodput={self.goodput:.3f} wall_seconds={self.wall_seconds:.1f}")


class LocalRunner:
    """Supervises attempts of one TrainingRun on this machine."""

    def __init__(self, run: api.TrainingRun, options: LocalOptions, secrets: dict[str, str],
                 out: TextIO = sys.stdout, display: Optional[Callable[["LocalRunner", dict], None]] = None):
        self.run = run
        self.spec = run.spec
        self.options = options
        self.secrets = secrets
        self.out = out
        self.display = display
        self.run_dir = Path(options.runs_dir) / run.metadata.name
        self.attempts: list[Attempt] = []
        self.groups: list[WorkerGroup] = []  #: every start of the workers, for attempts and lost steps
        self.restarts = recovery.Restarts()  #: attempts lost so far, by cause, as status.restarts counts them
        self.interrupted: Optional[int] = None  #: the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)
        self.current: Optional[subprocess.Popen] = None
        self._kill_steps = sorted(set(options.chaos_kill_steps))
        self._chaos = random.Random(options.chaos_seed)
        self.random_kills = 0  #: by --chaos-kill-every
        self.ledger = RunLedger.load(self.run_dir, self.spec.checkpoint.uri, uid=run.metadata.uid)

    @property
    def attempt_count(self) -> int:
        """Launcher attempts: what the cluster counts as attempts (one PyTorchJob each)."""
        return len(self.attempts)

    @property
    def restarts_in_place(self) -> int:
        """Worker groups torchrun restarted inside an attempt (spec.recovery.maxRestartsPerAttempt)."""
        return sum(1 for earlier, group in zip(self.groups, self.groups[1:]) if group.attempt == earlier.attempt)

    def attempt_label(self) -> str:
        """"attempt 2", or "attempt 2, restart 1 in place" once torchrun has restarted its worker group."""
        in_place = sum(1 for g in self.groups if g.attempt == self.attempt_count) - 1
        label = f"attempt {self.attempt_count}"
        return f"{label}, restart {in_place} in place" if in_place > 0 else label

    @property
    def nproc(self) -> int:
        return self.options.nproc or self.spec.nproc_per_node

    def _environment(self, attempt: int, status: StatusServer, config_path: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith((contract.PREFIX, "PET_"))}
        env.update({e.name: e.value for e in self.spec.env})
        env.update(self.secrets)
        users = {e.name for e in self.spec.env} | set(self.secrets)
        # As in a pod: the contract, where a default the user also set (OMP_NUM_THREADS, HOME, ...) is the user's.
        env.update({k: v for k, v in builders.contract_env(self.run, attempt, str(config_path)).items()
                    if k not in users or k.startswith(contract.PREFIX)})
        env.update({
            contract.REPORT_URL: status.url,
            contract.REPORT_TOKEN_FILE: str(status.token_file),
            contract.REPORT_INTERVAL_SECONDS: "0.1",
        })
        if self.options.metrics_port:
            env[contract.METRICS_PORT] = str(self.options.metrics_port)
        if "OMP_NUM_THREADS" in os.environ and "OMP_NUM_THREADS" not in users:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]  # the shell's choice
        elif "OMP_NUM_THREADS" not in users:
            # The pod's share of its CPU request, for this run's process count, and no more than this machine has.
            machine_share = max(1, (os.cpu_count() or 1) // self.nproc)
            env["OMP_NUM_THREADS"] = str(min(builders.omp_threads(self.spec, self.nproc) or machine_share,
                                             machine_share))
        return env

    def _write_config(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "config.yaml"
        config = RunConfig(trainer=self.spec.trainer, checkpoint=self.spec.checkpoint)
        path.write_text(yaml.safe_dump(config.to_wire(), sort_keys=False), encoding="utf-8")
        return path

    def _kill_a_worker(self, reason: str) -> None:
        if self.current is None:
            return
        workers = worker_pids(self.current.pid)
        if workers:
            victim = self._chaos.choice(workers)
            print(f"chaos: SIGKILL worker pid {victim} ({reason})", file=self.out, flush=True)
            self.random_kills += 1
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _supervise(self, process: subprocess.Popen, attempt: Attempt, status: StatusServer) -> int:
        log = LogFollower(attempt.log_path)
        next_random_kill = time.monotonic() + self.options.chaos_kill_every if self.options.chaos_kill_every else None
        while True:
            code = process.poll()
            for line in log.new_lines():
                self._on_log_line(line, attempt, status)
            group = self.groups[-1] if self.groups and self.groups[-1].attempt == attempt.number else None
            if group and status.report_count() > group.reports_before:  # not a dead group's last report
                step = int(status.snapshot().get("progress", {}).get("step") or 0)
                group.last_step = max(group.last_step, step)
            if self.display:
                self.display(self, status.snapshot())
            if code is not None:
                for line in log.new_lines():
                    self._on_log_line(line, attempt, status)
                return code
            if next_random_kill and time.monotonic() >= next_random_kill:
                self._kill_a_worker(f"--chaos-kill-every {self.options.chaos_kill_every:g}s")
                next_random_kill = time.monotonic() + self.options.chaos_kill_every
            status.wait_for_change(0.25)

    def _on_log_line(self, line: str, attempt: Attempt, status: StatusServer) -> None:
        started = GROUP_STARTED.search(line)
        if started:
            restarted_in_place = bool(self.groups) and self.groups[-1].attempt == attempt.number
            source, resumed = started.group(1), int(started.group(2) or 0)
            # Its reports are those from now on (the first, at the resumed step, may be in already: it adds nothing).
            self.groups.append(WorkerGroup(attempt.number, resumed_step=resumed, last_step=resumed,
                                           reports_before=status.report_count(), resumed=bool(source)))
            if restarted_in_place:
                print(f"{self.attempt_label()}: torchrun restarted the worker group in place "
                      f"(spec.recovery.maxRestartsPerAttempt={self.spec.recovery.max_restarts_per_attempt})",
                      file=self.out, flush=True)
            if source:
                print(f"{self.attempt_label()}: resumed from step {resumed} ({source})", file=self.out, flush=True)
            else:
                print(f"{self.attempt_label()}: no checkpoint to resume from, starting at step 0", file=self.out,
                      flush=True)
            return
        killed = CHAOS_KILLED.search(line)
        if killed:
            rank, step = int(killed.group(1)), int(killed.group(2))
            print(f"chaos: SIGKILL worker rank {rank} at step {step} (--chaos-kill-step)", file=self.out, flush=True)
            if self.groups:
                self.groups[-1].last_step = max(self.groups[-1].last_step, step)
            if step in self._kill_steps:
                self._kill_steps.remove(step)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        # Like a pod deletion: the agent forwards SIGTERM, workers checkpoint and exit 143.
        self.interrupted = signum
        if self.current and self.current.poll() is None:
            print(f"{STOP_SIGNALS[signum]}: stopping workers after an emergency checkpoint", file=self.out, flush=True)
            self.current.send_signal(signal.SIGTERM)

    def _interrupted_message(self) -> str:
        return f"stopped by {STOP_SIGNALS[self.interrupted]}; rerun the same command to resume"

    def execute(self) -> Summary:
        started = time.monotonic()
        config_path = self._write_config()
        status = StatusServer(self.run, self.run_dir / "report-token")
        previous = {signum: signal.signal(signum, self._on_stop_signal) for signum in STOP_SIGNALS}
        outcome, message = "succeeded", ""
        try:
            number = 0
            while True:
                if self.interrupted:  # during the backoff: start nothing more
                    outcome, message = "interrupted", self._interrupted_message()
                    break
                number += 1
                attempt = Attempt(number, log_path=self.run_dir / f"attempt-{number}.log")
                self.attempts.append(attempt)
                status.new_attempt(number)
                command = [sys.executable, "-m", "trainingrun_trainer.launch", "--standalone",
                           f"--nproc-per-node={self.nproc}", f"--max-restarts={self.spec.recovery.max_restarts_per_attempt}",
                           "--module", "trainingrun_trainer"]
                env = self._environment(number, status, config_path)
                if self._kill_steps:
                    # The trainer kills one of its workers itself, right after this step: precise.
                    env[contract.CHAOS_KILL_AT_STEP] = ",".join(map(str, self._kill_steps))
                with open(attempt.log_path, "w", encoding="utf-8") as log:
                    self.current = subprocess.Popen(
                        command, env=env,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                    attempt.code = self._supervise(self.current, attempt, status)
                _end_session(self.current)
                self.current = None
                kind = exit_codes.classify(attempt.code, stopping=bool(self.interrupted))
                if kind == exit_codes.SUCCEEDED:
                    break
                decision = recovery.after_attempt(self.spec.recovery, self.restarts, kind)
                if decision.stop_reason == "PermanentError":
                    outcome, message = "failed", attempt.trainer_message() or f"the trainer exited with {attempt.code}"
                    break
                if self.interrupted:
                    outcome, message = "interrupted", self._interrupted_message()
                    break
                self.restarts = decision.restarts
                if not decision.retry:
                    outcome = "failed"
                    message = (f"attempt {number} ended with exit code {attempt.code} ({kind}); the recovery budget "
                               + decision.budget_words())
                    break
                delay = decision.delay_seconds
                print(f"attempt {number} ended with exit code {attempt.code} ({kind}); "
                      f"attempt {number + 1} resumes from the last good checkpoint in {delay}s", file=self.out, flush=True)
                if delay:
                    time.sleep(delay)  # the backoff itself, as the operator would wait
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.current:  # an exception while it ran: its whole process group goes, the launcher included
                _end_session(self.current)
                self.current.wait()
            final = status.snapshot()
            status.close()
        return self._summary(final, time.monotonic() - started, outcome, message)

    def _summary(self, status: dict, wall: float, outcome: str, message: str) -> Summary:
        """The run's figures, goodput over every invocation; adds this invocation's wall time to the run's ledger."""
        progress = status.get("progress", {})
        lost = sum(max(0, a.last_step - b.resumed_step) for a, b in zip(self.groups, self.groups[1:]))
        productive = float(progress.get("productiveSeconds") or 0.0)
        steps = int(progress.get("step") or (self.groups[-1].resumed_step if self.groups else 0))
        if self.groups and not self.groups[0].resumed:
            self.ledger.wall_seconds = 0.0  # no checkpoint to resume: the run started over, its time with it
        self.ledger.wall_seconds += wall
        self.ledger.save()
        total_wall = self.ledger.wall_seconds
        first = self.groups[0] if self.groups else None
        if outcome == "succeeded" and first and first.resumed and first.resumed_step >= self.spec.trainer.max_steps:
            message = (f"{self.run.metadata.name} had already finished: the checkpoint at step {first.resumed_step} "
                       f"in {self.spec.checkpoint.uri} is its last step (spec.trainer.maxSteps="
                       f"{self.spec.trainer.max_steps}), so nothing was trained; raise --max-steps to train on, or "
                       f"give another --checkpoint-uri to start over")
        return Summary(
            steps=steps,
            final_loss=progress.get("loss"),
            attempts=self.attempt_count,
            restarts_in_place=self.restarts_in_place,
            lost_steps=lost,
            goodput=contract.goodput(productive, total_wall) or 0.0,
            wall_seconds=wall,
            outcome=outcome,
            message=message,
            stop_signal=self.interrupted,
            chaos_notes=self._chaos_that_never_fired(wall),
        )

    def _chaos_that_never_fired(self, wall: float) -> list[str]:
        notes = [f"chaos: --chaos-kill-step {step} never fired (the workers never computed step {step} in this "
                 f"invocation)" for step in self._kill_steps]
        if self.options.chaos_kill_every and not self.random_kills:
            notes.append(f"chaos: --chaos-kill-every {self.options.chaos_kill_every:g} never fired: the run ended "
                         f"after {wall:.1f} s; use a shorter interval or more --max-steps")
        return notes


# ---------------------------------------------------------------- showing progress


class PlainDisplay:
    """Log lines for pipes and CI: one when the step moves by a tenth of the run or 10 s pass."""

    def __init__(self, out: TextIO):
        self.out, self.last_step, self.last_time = out, -1, 0.0

    def __call__(self, runner: LocalRunner, status: dict) -> None:
        progress = status.get("progress", {})
        step, total = progress.get("step"), progress.get("totalSteps")
        if step is None or step == self.last_step:
            return
        now = time.monotonic()
        if total and step - self.last_step < max(1, total // 10) and now - self.last_time < 10 and step != total:
            return
        self.last_step, self.last_time = step, now
        loss, rate = progress.get("loss"), progress.get("samplesPerSecond")
        print(f"{runner.attempt_label()} step {step}/{total} loss {'-' if loss is None else f'{loss:.4f}'} "
              f"samples/s {'-' if rate is None else f'{rate:.1f}'}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class RichDisplay:
    """A live progress bar for terminals: step/total, loss, samples/s, ETA, attempt."""

    def __init__(self, out: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.fields[attempt]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TimeRemainingColumn(),
            console=Console(file=out),
        )
        self.task = None
        self.progress.start()

    def __call__(self, runner: LocalRunner, status: dict) -> None:
        progress = status.get("progress", {})
        total = progress.get("totalSteps") or runner.spec.trainer.max_steps
        if self.task is None:
            self.task = self.progress.add_task("train", total=total, attempt=runner.attempt_label(), loss="-",
                                              rate="-")
        loss = progress.get("loss")
        self.progress.update(
            self.task, completed=progress.get("step") or 0, total=total, attempt=runner.attempt_label(),
            loss="-" if loss is None else f"{loss:.4f}",
            rate="-" if progress.get("samplesPerSecond") is None else f"{progress['samplesPerSecond']:.0f}",
        )

    def close(self) -> None:
        self.progress.stop()
