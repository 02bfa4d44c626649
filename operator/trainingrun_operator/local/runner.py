"""The supervisor of a local run: attempts, in-place restarts, recovery and fault injection; what it prints at the
end is summary.py's."""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from trainingrun_api import contract, exit_codes, progress_report, run_figures
from trainingrun_api.config import RunConfig, config_json

from .. import api, pod_env, recovery
from .inputs import LocalOptions
from .ledger import RunLedger, run_directory
from .processes import (
    PROCESS_TAG,
    Launcher,
    as_pet_variables,
    free_port,
    inductor_cache,
    node_rendezvous,
    own_command,
    remove_orphaned_semaphores,
    semaphores_mapped,
    wait_for_tagged_to_end,
    worker_pids,
)
from .status_server import StatusServer
from .summary import Summary

#: Rank 0 says one of these when a worker group starts training (each attempt, each in-place restart).
GROUP_STARTED = re.compile(
    r"(?:resumed from (\S+) at step (\d+)(?: in [\d.]+ s, reading ([a-z ]+) \()?|no checkpoint to resume from)"
)
CHAOS_KILLED = re.compile(r"chaos: SIGKILL worker rank (\d+) at step (\d+)")
#: A node's local rank 0 says so, stopped, after the step `--chaos-lose-node` names (`contract.CHAOS_LOSE_NODE_AT_STEP`).
NODE_LOST = re.compile(r"chaos: node lost at step (\d+)")
#: The rank that diagnosed a hang says so (hangs.py); the detail lines that follow start with two more spaces.
HANG_DIAGNOSIS = re.compile(r"hang diagnosis: (\S.*)$")
#: Rank 0 names a straggler (stragglers.py).
SLOW_RANK = re.compile(r"slow rank: (rank \d+ .*)$")


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
        said = [
            line
            for line in lines
            if line.startswith(("trainingrun-trainer:", "trainingrun:", "trainingrun launch: cannot"))
            or " ERROR trainingrun" in line
        ]
        if said:
            return "\n".join(dict.fromkeys(said))  # each once, in order
        # Nothing of ours said why (a script of one's own raised): the end of the first traceback, where it did.
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent")), None)
        if start is None:
            return ""
        end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), start)
        return f"the trainer failed, {self.log_path.name} says:\n" + "\n".join(lines[max(start, end - 4) : end + 1])


#: Seconds the other nodes' launchers get to end after one node's has (torchrun's agents notice a lost peer within
#: launch.POD_KEEP_ALIVE, a few seconds); then they are stopped.
NODE_GRACE_SECONDS = 30.0


#: Signals that stop a local run as a pod deletion would (emergency checkpoint, workers gone), by how they are named.
STOP_SIGNALS: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


class LocalRunner:
    """Supervises attempts of one TrainingRun on this machine."""

    def __init__(
        self,
        run: api.TrainingRun,
        options: LocalOptions,
        secrets: dict[str, str],
        out: TextIO = sys.stdout,
        display: Optional[Callable[["LocalRunner", dict], None]] = None,
    ):
        self.run = run
        self.spec = run.spec
        self.options = options
        self.secrets = secrets
        self.out = out
        self.started_at = time.time()  # what this run's lost nodes leave in /dev/shm is newer (`_replace_node`)
        self.display = display
        self.run_dir = run_directory(Path(options.runs_dir), run.metadata.name, self.spec.checkpoint.uri)
        self.attempts: list[Attempt] = []
        self.groups: list[WorkerGroup] = []  #: every start of the workers, for attempts and lost steps
        self.restarts = recovery.Restarts()  #: attempts lost so far, by cause, as status.restarts counts them
        self.interrupted: Optional[int] = None  #: the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)
        self.launchers: list[Launcher] = []  #: the current attempt's, one per node
        #: This invocation's temporary folder, the processes' TMPDIR (torchrun's, the launcher's, metrics): removed
        #: when it ends, so a run leaves nothing in /tmp, its killed processes' folders included.
        self.scratch: Optional[str] = None
        self._kill_steps = sorted(set(options.chaos_kill_steps))
        self._chaos = random.Random(options.chaos_seed)
        self.random_kills = 0  #: by --chaos-kill-every
        self.node_replacements = 0  #: nodes lost and replaced by --chaos-lose-node
        self.hangs: list[str] = []  #: each hang's one-line diagnosis
        self.slow_ranks: list[str] = []  #: each straggler named, in words
        self.backoff_seconds = 0.0  #: waited out between attempts in this invocation
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
        """ "attempt 2", or "attempt 2, restart 1 in place" once torchrun has restarted its worker group."""
        in_place = sum(1 for g in self.groups if g.attempt == self.attempt_count) - 1
        label = f"attempt {self.attempt_count}"
        return f"{label}, restart {in_place} in place" if in_place > 0 else label

    @property
    def run_key(self) -> str:
        """What names the run's node memory and rendezvous: its uid (its name where it has none)."""
        return self.run.metadata.uid or self.run.metadata.name

    @property
    def nproc(self) -> int:
        return self.options.nproc or self.spec.nproc_per_node

    def _environment(self, attempt: int, status: StatusServer, config_path: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith((contract.PREFIX, "PET_"))}
        env[contract.MEMORY_TIER_ROOT_ENV] = contract.memory_tier_root()  # this machine's node memory (or the tests')
        env.update({e.name: e.value for e in self.spec.env})
        env.update(self.secrets)
        users = {e.name for e in self.spec.env} | set(self.secrets)
        # As in a pod: the contract, where a default the user also set (OMP_NUM_THREADS, HOME, ...) is the user's.
        env.update(
            {
                k: v
                for k, v in pod_env.contract_env(self.run, attempt, str(config_path)).items()
                if k not in users or k.startswith(contract.PREFIX)
            }
        )
        env.update(
            {
                contract.REPORT_URL: status.url,
                contract.REPORT_TOKEN_FILE: str(status.token_file),
                contract.REPORT_INTERVAL_SECONDS: "0.1",
            }
        )
        # A pod's metrics port (spec.metrics) is its own; on this machine metrics are served only when asked, on the
        # port asked for: the default (9464) is often taken here (OpenTelemetry's Prometheus exporter uses it).
        env.pop(contract.METRICS_PORT, None)
        if self.options.metrics_port:
            env[contract.METRICS_PORT] = str(self.options.metrics_port)
        if self.scratch and "TMPDIR" not in users:
            env["TMPDIR"] = self.scratch
            # torch.compile's cache stays where torch keeps it by default (below the temporary folder), warm for
            # the next run, not in the folder this invocation removes.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache())
        if "OMP_NUM_THREADS" in os.environ and "OMP_NUM_THREADS" not in users:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]  # the shell's choice
        elif "OMP_NUM_THREADS" not in users:
            # The pod's share of its CPU request, for this run's process count, and no more than this machine has.
            machine_share = max(1, (os.cpu_count() or 1) // self.nproc)
            env["OMP_NUM_THREADS"] = str(
                min(pod_env.omp_threads(self.spec, self.nproc) or machine_share, machine_share)
            )
        return env

    def _write_config(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / contract.CONFIG_FILE_NAME
        (self.run_dir / contract.CHAOS_HANG_FIRED_FILE).unlink(missing_ok=True)  # --chaos-hang: once per invocation
        config = RunConfig(trainer=self.spec.trainer, checkpoint=self.spec.checkpoint)
        path.write_text(config_json(config), encoding="utf-8")
        return path

    def _kill_a_worker(self, reason: str) -> None:
        workers = [pid for launcher in self.launchers for pid in worker_pids(launcher.process.pid)]
        if workers:
            victim = self._chaos.choice(workers)
            print(f"chaos: SIGKILL worker pid {victim} ({reason})", file=self.out, flush=True)
            self.random_kills += 1
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _supervise(self, launchers: list["Launcher"], attempt: Attempt, status: StatusServer) -> int:
        """Until every launcher of the attempt has exited: the first non-zero exit code, else 0. Once one node's
        launcher has ended, the others get `NODE_GRACE_SECONDS` to end too (a lost node's peers give up on its
        rendezvous), then their workers are stopped as a deleted pod's would be."""
        every = self.options.chaos_kill_every
        next_random_kill = time.monotonic() + every if every else None
        first_ended: Optional[float] = None
        while True:
            for index, launcher in enumerate(launchers):
                for line in launcher.log.new_lines():
                    self._on_log_line(line, attempt, status)
                    lost = NODE_LOST.search(line)
                    if lost:
                        launchers[index] = self._replace_node(launcher, int(lost.group(1)))
                        break
            codes = [launcher.process.poll() for launcher in launchers]
            ended = [code for code in codes if code is not None]
            code: Optional[int] = None
            if len(ended) == len(codes):
                code = next((c for c in ended if c != 0), 0)
            elif ended and first_ended is None:
                first_ended = time.monotonic()
            elif first_ended is not None and time.monotonic() - first_ended > NODE_GRACE_SECONDS:
                for launcher, running in zip(launchers, codes):
                    if running is None:
                        launcher.process.send_signal(signal.SIGTERM)
                first_ended = float("inf")  # told once; their exits end the attempt
            group = self.groups[-1] if self.groups and self.groups[-1].attempt == attempt.number else None
            if group and status.report_count() > group.reports_before:  # not a dead group's last report
                step = int(status.snapshot().get("progress", {}).get("step") or 0)
                group.last_step = max(group.last_step, step)
            if self.display:
                self.display(self, status.snapshot())
            if code is not None:
                for launcher in launchers:
                    for line in launcher.log.new_lines():
                        self._on_log_line(line, attempt, status)
                return code
            if every and next_random_kill and time.monotonic() >= next_random_kill:
                self._kill_a_worker(f"--chaos-kill-every {every:g}s")
                next_random_kill = time.monotonic() + every
            status.wait_for_change(0.25)

    def _replace_node(self, launcher: Launcher, step: int) -> Launcher:
        """`--chaos-lose-node`: every process of the node SIGKILLed at once (no SIGTERM, no emergency checkpoint) and
        its node memory gone, as when a node fails; then a new launcher for it, as Kubeflow recreates the pod, which
        rejoins the rendezvous with an empty node memory."""
        print(
            f"chaos: node {launcher.node} lost at step {step}: every process SIGKILLed, its node memory gone; "
            "starting a replacement (--chaos-lose-node)",
            file=self.out,
            flush=True,
        )
        self.node_replacements += 1
        if self.groups:
            self.groups[-1].last_step = max(self.groups[-1].last_step, step)
        lost_semaphores = semaphores_mapped(launcher.processes())  # before they are gone
        launcher.close()
        wait_for_tagged_to_end(launcher.env[PROCESS_TAG])  # its semaphores are unmapped once its processes are gone
        remove_orphaned_semaphores(made_before=time.time(), made_after=self.started_at, only=lost_semaphores)
        memory = launcher.env[contract.MEMORY_TIER_ROOT_ENV]
        shutil.rmtree(memory, ignore_errors=True)
        os.makedirs(memory, exist_ok=True)
        env = {key: value for key, value in launcher.env.items() if key != contract.CHAOS_LOSE_NODE_AT_STEP}
        log_path = Path(launcher.log.path)
        replacement = log_path.with_name(f"{log_path.stem}-replacement-{self.node_replacements}.log")
        return Launcher.start(launcher.node, launcher.command, env, replacement)

    def _on_log_line(self, line: str, attempt: Attempt, status: StatusServer) -> None:
        started = GROUP_STARTED.search(line)
        if started:
            restarted_in_place = bool(self.groups) and self.groups[-1].attempt == attempt.number
            source, resumed = started.group(1), int(started.group(2) or 0)
            # Its reports are those from now on (the first, at the resumed step, may be in already: it adds nothing).
            self.groups.append(
                WorkerGroup(
                    attempt.number,
                    resumed_step=resumed,
                    last_step=resumed,
                    reports_before=status.report_count(),
                    resumed=bool(source),
                )
            )
            if restarted_in_place:
                print(
                    f"{self.attempt_label()}: torchrun restarted the worker group in place "
                    f"(spec.recovery.maxRestartsPerAttempt={self.spec.recovery.max_restarts_per_attempt})",
                    file=self.out,
                    flush=True,
                )
            if source:
                read = f", reading {started.group(3)}" if started.group(3) else ""  # own memory, a peer's, storage
                print(
                    f"{self.attempt_label()}: resumed from step {resumed} ({source}){read}", file=self.out, flush=True
                )
            else:
                print(
                    f"{self.attempt_label()}: no checkpoint to resume from, starting at step 0",
                    file=self.out,
                    flush=True,
                )
            return
        hang = HANG_DIAGNOSIS.search(line)
        if hang:
            self.hangs.append(hang.group(1))
            print(f"{self.attempt_label()}: {hang.group(1)}", file=self.out, flush=True)
            return
        slow = SLOW_RANK.search(line)
        if slow:
            self.slow_ranks.append(slow.group(1))
            print(f"{self.attempt_label()}: slow {slow.group(1)}", file=self.out, flush=True)
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
        running = [launcher for launcher in self.launchers if launcher.process.poll() is None]
        if running:
            print(f"{STOP_SIGNALS[signum]}: stopping workers after an emergency checkpoint", file=self.out, flush=True)
        for launcher in running:
            launcher.process.send_signal(signal.SIGTERM)

    def _interrupted_message(self) -> str:
        return f"stopped by {STOP_SIGNALS.get(self.interrupted or 0, 'a signal')}; rerun the same command to resume"

    def execute(self) -> Summary:
        started = time.monotonic()
        config_path = self._write_config()
        status = StatusServer(self.run, self.run_dir / "report-token")
        previous = {signum: signal.signal(signum, self._on_stop_signal) for signum in STOP_SIGNALS}
        outcome, message = "succeeded", ""
        # Made last before the try whose end removes it (a status server that could not start left it behind).
        # Short: the processes' Unix sockets live below it (pymp-*/listener-*), and their paths stop at 107 bytes.
        self.scratch = tempfile.mkdtemp(prefix="trainingrun-")
        try:
            number = 0
            while True:
                if self.interrupted:  # during the backoff: start nothing more
                    outcome, message = "interrupted", self._interrupted_message()
                    break
                number += 1
                log_path = self.run_dir / f"attempt-{number}.log"
                attempt = Attempt(number, log_path=log_path)
                self.attempts.append(attempt)
                status.new_attempt(number)
                env = self._environment(number, status, config_path)
                if self.options.chaos_hang and number == 1:
                    env[contract.CHAOS_HANG] = self.options.chaos_hang
                if self.options.chaos_slow_rank and number == 1:
                    env[contract.CHAOS_SLOW_RANK] = self.options.chaos_slow_rank
                if self._kill_steps:
                    # The trainer kills one of its workers itself, right after this step: precise.
                    env[contract.CHAOS_KILL_AT_STEP] = ",".join(map(str, self._kill_steps))
                self.launchers = self._start_launchers(number, env, log_path)
                try:
                    attempt.code = self._supervise(self.launchers, attempt, status)
                finally:
                    for launcher in self.launchers:
                        launcher.close()
                self.launchers = []
                self._free_node_memory()  # the attempt's pods are gone: so is what they kept in /dev/shm
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
                    message = (
                        f"attempt {number} ended with exit code {attempt.code} ({kind}); the recovery budget "
                        + decision.budget_words()
                    )
                    break
                delay = decision.delay_seconds
                print(
                    f"attempt {number} ended with exit code {attempt.code} ({kind}); "
                    f"attempt {number + 1} resumes from the last good checkpoint in {delay}s",
                    file=self.out,
                    flush=True,
                )
                if delay:
                    waited = time.monotonic()
                    time.sleep(delay)  # the backoff itself, as the operator would wait
                    self.backoff_seconds += time.monotonic() - waited
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.launchers:  # an exception while they ran: their whole process groups go, launchers included
                for launcher in self.launchers:
                    launcher.close()
                self.launchers = []
                self._free_node_memory()
            final, processes = status.snapshot(), status.process_times()
            status.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self._summary(final, time.monotonic() - started, outcome, message, processes)

    def _free_node_memory(self) -> None:
        for kept in glob.glob(
            contract.memory_tier_dirs(contract.memory_tier_key(self.run_key, self.spec.checkpoint.uri))
        ):
            shutil.rmtree(kept, ignore_errors=True)
        for node in range(self.options.nodes if self.options.nodes > 1 else 0):
            shutil.rmtree(self._node_memory(node), ignore_errors=True)

    def _node_memory(self, node: int) -> str:
        """The folder a simulated node keeps as its node memory (a pod's /dev/shm), below this machine's."""
        return os.path.join(contract.memory_tier_root(), f"trainingrun-{self.run_key}-node-{node}")

    def _start_launchers(self, attempt: int, env: dict[str, str], log_path: Path) -> list["Launcher"]:
        """The attempt's launchers: one (--standalone), or one per simulated node as in a PyTorchJob's pods (c10d
        rendezvous hosted by node 0 on 127.0.0.1, each node's own memory folder and log: attempt-N.log for node 0,
        attempt-N-node-I.log for the others)."""
        torchrun = [f"--nproc-per-node={self.nproc}", f"--max-restarts={self.spec.recovery.max_restarts_per_attempt}"]
        own = own_command(self.spec)

        def start(node: int, options: list[str], node_env: dict[str, str], path: Path) -> Launcher:
            """The built-in trainer under our launcher with torchrun's `options`; or the spec's own command, given
            them as a pod is, as PET_* variables (which torchrun reads)."""
            if own is not None:
                return Launcher.start(node, own, {**node_env, **as_pet_variables(options)}, path)
            command = [sys.executable, "-m", "trainingrun_trainer.launch", *options, "--module", "trainingrun_trainer"]
            return Launcher.start(node, command, node_env, path)

        nodes = self.options.nodes
        if nodes == 1:
            return [start(0, ["--standalone", *torchrun], env, log_path)]
        port = free_port()
        job = f"{self.run.metadata.name}-a{attempt}"
        launchers = []
        for node in range(nodes):
            memory = self._node_memory(node)
            os.makedirs(memory, exist_ok=True)
            node_env = {
                **env,
                contract.MEMORY_TIER_ROOT_ENV: memory,
                # As the operator's pods have them: launch.pod_rendezvous makes worker 0 host the store.
                contract.POD_NAME: f"{job}-worker-{node}",
                contract.POD_IP: "127.0.0.1",
                contract.RENDEZVOUS_HOST_POD: f"{job}-worker-0",
            }
            rendezvous = node_rendezvous(nodes, node, port, f"{self.run_key}-a{attempt}")
            if node == nodes - 1 and attempt == 1 and self.options.chaos_lose_node_step is not None:
                node_env[contract.CHAOS_LOSE_NODE_AT_STEP] = str(self.options.chaos_lose_node_step)
            path = log_path if node == 0 else log_path.with_name(f"{log_path.stem}-node-{node}.log")
            launchers.append(start(node, [*rendezvous, *torchrun], node_env, path))
        return launchers

    def _summary(
        self, status: dict, wall: float, outcome: str, message: str, processes: list[progress_report.ProcessTime]
    ) -> Summary:
        """The run's figures, goodput over every invocation; adds this invocation's wall time to the run's ledger."""
        progress = status.get("progress", {})
        lost = sum(max(0, a.last_step - b.resumed_step) for a, b in zip(self.groups, self.groups[1:]))
        steps = int(progress.get("step") or (self.groups[-1].resumed_step if self.groups else 0))
        if self.groups and not self.groups[0].resumed:
            # No checkpoint to resume: the run started over, its time with it.
            self.ledger.wall_seconds = self.ledger.productive_seconds = 0.0
        reported = progress.get("productiveSeconds")
        # An invocation whose processes never reported (one that failed early) kept the productive time before it.
        productive = float(reported) if reported is not None else self.ledger.productive_seconds
        self.ledger.wall_seconds += wall
        self.ledger.productive_seconds = productive
        self.ledger.save()
        total_wall = self.ledger.wall_seconds
        first = self.groups[0] if self.groups else None
        if outcome == "succeeded" and first and first.resumed and first.resumed_step >= self.spec.trainer.max_steps:
            message = (
                f"{self.run.metadata.name} had already finished: the checkpoint at step {first.resumed_step} "
                f"in {self.spec.checkpoint.uri} is its last step (spec.trainer.maxSteps="
                f"{self.spec.trainer.max_steps}), so nothing was trained; raise --max-steps to train on, or "
                f"give another --checkpoint-uri to start over"
            )
        return Summary(
            steps=steps,
            final_loss=progress.get("loss"),
            attempts=self.attempt_count,
            restarts_in_place=self.restarts_in_place,
            lost_steps=lost,
            goodput=run_figures.goodput(productive, total_wall) or 0.0,
            wall_seconds=wall,
            run_wall_seconds=total_wall,
            run_productive_seconds=productive,
            outcome=outcome,
            message=message,
            stop_signal=self.interrupted,
            chaos_notes=self._chaos_that_never_fired(wall),
            breakdown=run_figures.time_breakdown(wall, processes, productive, self.backoff_seconds),
            checkpoint_interval=status.get("checkpointInterval"),
            samples_per_second=progress.get("samplesPerSecond"),
            model_flops_per_second=progress.get("modelFlopsPerSecond"),
            mfu=progress.get("mfu"),
            startup={
                part: sum(p.startup_parts()[part] for p in processes)
                for part in progress_report.ProcessTime.STARTUP_PARTS
            }
            if processes
            else {},
            process_starts=len(processes),
            average_samples_per_second=_average_throughput(processes),
            eval_loss=progress.get("evalLoss"),
            eval_step=progress.get("evalStep"),
            hangs=self.hangs,
            slow_ranks=self.slow_ranks,
        )

    def _chaos_that_never_fired(self, wall: float) -> list[str]:
        notes = [
            f"chaos: --chaos-kill-step {step} never fired (the workers never computed step {step} in this invocation)"
            for step in self._kill_steps
        ]
        if self.options.chaos_lose_node_step is not None and not self.node_replacements:
            notes.append(
                f"chaos: --chaos-lose-node {self.options.chaos_lose_node_step} never fired (the first worker group "
                "never computed that step)"
            )
        if self.options.chaos_kill_every and not self.random_kills:
            notes.append(
                f"chaos: --chaos-kill-every {self.options.chaos_kill_every:g} never fired: the run ended "
                f"after {wall:.1f} s; use a shorter interval or more --max-steps"
            )
        return notes


def _average_throughput(processes: list[progress_report.ProcessTime]) -> Optional[float]:
    """Samples/s over every reported step's compute and data wait (None where no process counted its samples)."""
    samples = sum(p.trained_samples for p in processes)
    seconds = sum(p.compute_seconds + p.data_wait_seconds for p in processes)
    return samples / seconds if samples > 0 and seconds > 0 else None
