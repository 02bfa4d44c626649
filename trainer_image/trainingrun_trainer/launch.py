"""Container entry point: torchrun's elastic agent, with exit codes that keep their meaning.

`torchrun` exits 1 whenever any worker fails, so a preempted worker (143) or a killed one (137)
would look like a permanent error to a PyTorchJob with `restartPolicy: ExitCode`, and a retryable
failure would never be retried. This runs the same agent in-process (same arguments as torchrun)
and turns the workers' exit codes into the container's: a permanent code (1-127) from any worker
deliberately chosen by the trainer wins; a worker killed by a signal explains its peers' failures;
SIGTERM becomes 143 (see `container_exit_code`).

In a pod the agent is PID 1, which the kernel shields from every signal it has no handler for, and
torch installs its SIGTERM handler only when workers start: `main` installs one from the start, so a
pod deleted while it waits in rendezvous stops at once (143) instead of after the grace period.
A lost rendezvous store (its host, worker-0, deleted) does not end this pod: the agent is started
again in this container and waits for the replacement host's store (up to the rendezvous
`read_timeout`, `REJOINS` times), so only the lost pod is recreated; Kubeflow replacing the survivor too
made losing worker-0 ~2 s slower than losing another worker (benchmarks/cluster_recovery.py). When the
store does not come back, or a round times out, the container exits retryable (138): the pod is
restarted and rejoins, instead of the whole run failing permanently on torchrun's exit 1. Peers reach
the store through the run's rendezvous Service and each other by pod IP (see `pod_rendezvous`), so a
replacement is reachable as soon as it listens, with no wait for DNS.

    python -m trainingrun_trainer.launch [torchrun options] --module trainingrun_trainer

For the built-in trainer module, workers are forked from a forkserver that has already imported
torch and the trainer, so a worker group restarted in place (`--max-restarts`, the PyTorchJob's
elasticPolicy.maxRestarts) starts in well under a second instead of re-importing for seconds:
restart time is most of what a crash costs (benchmarks/goodput.py). A deliberate permanent exit
(bad config, divergence) is remembered for the rest of the attempt, so the restarted groups exit
the same way at once instead of failing slowly `--max-restarts` more times.

`--max-restarts` (spec.recovery.maxRestartsPerAttempt) counts in-place restarts in a row without a new
committed checkpoint: a worker group that committed one since the last restart gets the whole budget
back (`RestartBudget`). torchrun's budget is for the attempt's life, so a long run with an occasional
crash spent it in a few days and then paid a whole new attempt (new pods, imports, rendezvous) for
every later crash; a group that crashes again before saving anything still ends the attempt.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from trainingrun_api import contract, exit_codes

from . import hang_store
from .preloading import TRAINER_MODULE, preload, start_forkserver

#: Agent restarts in this container after its rendezvous store was lost, before exiting retryable.
REJOINS = 2


def container_exit_code(worker_codes: Iterable[int]) -> int:
    """One exit code for the container from its failed workers' exit codes.

    Precedence, because peers of a failed worker fail too, as a consequence:
    1. a deliberate permanent code (2-127: bad config, divergence) from any worker;
    2. a worker killed by a signal other than SIGTERM (OOM killer, chaos): 128+signal, retryable;
       its peers then die in a broken collective with exit 1, which must not read as permanent;
    3. 143, a worker's deliberate exit after its emergency checkpoint (preemption): 143;
    4. 1 (an uncaught exception; peers killed by SIGTERM were only stopped by the agent): permanent;
    5. death by SIGTERM alone (a script without a handler, pod deletion): 143.
    """
    codes = list(worker_codes)
    for code in codes:
        if 2 <= code <= 127:
            return code
    for code in codes:
        if code < 0 and code != -signal.SIGTERM:
            return 128 + (-code)
        if code > 128 and code not in (exit_codes.PREEMPTED,):
            return min(code, 255)
    if exit_codes.PREEMPTED in codes:  # a worker checkpointed and exited on SIGTERM: preemption
        return exit_codes.PREEMPTED
    if 1 in codes:  # peers merely stopped by the agent (-15) do not explain an exception
        return 1
    if -signal.SIGTERM in codes:
        return exit_codes.PREEMPTED
    return exit_codes.RETRYABLE


VERDICT_FILE = "permanent-exit-code"  #: in the launcher's scratch directory: a worker's deliberate permanent exit
COMMITTED_STEP_FILE = "committed-step"  #: in the launcher's scratch directory: the newest committed step


def run_trainer_worker(scratch: str, store_endpoint: str, *argv: str) -> None:
    """One worker of the built-in trainer, forked from the preloaded forkserver (whose environment is the
    launcher's before it set `store_endpoint`, contract.HANG_STORE: "" for none)."""
    verdict = Path(scratch) / VERDICT_FILE
    if verdict.exists():  # an earlier worker group of this attempt chose a permanent exit
        sys.exit(int(verdict.read_text()))
    os.environ[contract.COMMITTED_STEP_FILE] = str(Path(scratch) / COMMITTED_STEP_FILE)
    if store_endpoint:
        os.environ[contract.HANG_STORE] = store_endpoint
    from .main import main as trainer_main

    code = trainer_main(argv)
    if 2 <= code <= 127:  # deliberate (exit 1 may be a peer's broken collective)
        verdict.write_text(str(code))
    # Not main.exit_now: ending a worker with os._exit left the elastic agent waiting forever for the worker
    # group (tests/integration/test_trainer_faults.py hung); the agent needs the interpreter's own exit here.
    sys.exit(code)


class RestartBudget:
    """In-place restarts left to a launcher's agent, counted in a row without a newly committed checkpoint.

    `progressed()` reads the step the workers last committed (they write it to `committed_step_file`) and says
    whether it changed since it last looked: the failed group made progress that survives it. `restore(spec,
    remaining)` then gives the agent back `per_attempt` restarts while keeping its restart count (the workers'
    TORCHELASTIC_RESTART_COUNT, which `--chaos-kill-step` and the start counts read) growing."""

    def __init__(self, committed_step_file: Path, per_attempt: int):
        self.committed_step_file = committed_step_file
        self.per_attempt = per_attempt
        self.committed: Optional[str] = None  #: the committed step seen at the last failure

    def progressed(self) -> bool:
        try:
            committed = self.committed_step_file.read_text().strip() or None
        except OSError:
            committed = None
        if committed is None or committed == self.committed:
            return False
        self.committed = committed
        return True

    def restore(self, spec: Any, remaining: int) -> int:
        """Restarts left after a failure that followed progress; `spec.max_restarts` grows by those already done."""
        spec.max_restarts = spec.max_restarts - remaining + self.per_attempt
        return self.per_attempt


def _progress_aware_agent(budget: RestartBudget) -> Any:
    """torch's LocalElasticAgent, whose restart budget `budget` refills after progress (see the module doc)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ProgressAwareAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED) and budget.progressed():
                used = worker_group.spec.max_restarts - self._remaining_restarts
                self._remaining_restarts = budget.restore(worker_group.spec, self._remaining_restarts)
                if used:
                    print(
                        f"trainingrun launch: the worker group committed step {budget.committed} since its last "
                        f"restart: {budget.per_attempt} in-place restarts left again (--max-restarts, "
                        f"spec.recovery.maxRestartsPerAttempt, counts restarts without a new checkpoint)",
                        file=sys.stderr,
                        flush=True,
                    )
            return result

    return ProgressAwareAgent


def _plain_torch_log_format() -> None:
    """The agent's torch log lines, formatted without torch's formatter.

    torch's formatter imports all of torch._dynamo (1-1.5 s here) the first time it formats an
    exception, and the agent formats one exactly when a worker has died: the first in-place
    restart would wait for it. Same glog-like prefix, plain `logging.Formatter`.
    """
    import logging

    plain = logging.Formatter(
        "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(pathname)s:%(lineno)d] %(message)s",
        datefmt="%m%d %H:%M:%S",
    )
    for name in ("torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            if type(handler.formatter).__name__ == "TorchLogsFormatter":
                handler.setFormatter(plain)


class MetricsPortTaken(Exception):
    """TRAININGRUN_METRICS_PORT cannot be listened on: the message names the port and where it is set."""


def _serve_metrics() -> None:
    """Every worker of this launcher writes its series to one directory; the launcher serves them all
    on TRAININGRUN_METRICS_PORT, also while torchrun restarts the workers."""
    port = os.environ.get(contract.METRICS_PORT)
    if not port:
        return
    from . import metrics

    directory = tempfile.mkdtemp(prefix="trainingrun-metrics-")
    os.environ[metrics.MULTIPROC_DIR] = directory  # before any worker (or the forkserver) starts
    try:
        metrics.serve(int(port), directory)
    except OSError as error:
        raise MetricsPortTaken(
            f"cannot serve metrics on port {port} ({contract.METRICS_PORT}: spec.metrics.port in a pod, "
            f"--metrics-port under trainingrun local): {error.strerror or error}; pick a free port, or turn metrics "
            "off (spec.metrics.enabled: false; leave --metrics-port out)"
        ) from None


#: In a pod, a peer that stops sending keep-alives is dropped from the rendezvous after 1 s x 2 instead of torch's
#: 5 s x 3: a replacement pod (a new node: its own IP) waited those 15 s for the lost one to be dropped.
POD_KEEP_ALIVE = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}


def pod_rendezvous(args: Any, env: Any = os.environ) -> None:
    """Rendezvous settings for an agent in a pod (the user's own --local-addr and rdzv-conf keys win):

    - its address (MASTER_ADDR when it is rank 0) is the pod IP: an IP works the moment the pod exists, its DNS
      name only once the record appears and the peers' cached "no such name" (5 s in CoreDNS) expires;
    - lost peers are dropped after `POD_KEEP_ALIVE`;
    - the rendezvous host pod (worker 0, whose peers reach it through the run's rendezvous Service) hosts the
      store and reaches it itself on localhost: torch would otherwise guess the host by matching the endpoint
      against its own hostname, which a Service name never matches."""
    if args.standalone or not env.get(contract.POD_NAME):
        return
    if env.get(contract.POD_IP) and not args.local_addr:
        args.local_addr = env[contract.POD_IP]
    conf = dict(POD_KEEP_ALIVE)
    host_pod = env.get(contract.RENDEZVOUS_HOST_POD)
    # By name (a PyTorchJob's pods) or by hostname (a JobSet's: the Job controller adds a random suffix to the name)
    if host_pod and host_pod in (env[contract.POD_NAME], socket.gethostname()):
        port = args.rdzv_endpoint.rpartition(":")[2] or str(contract.RENDEZVOUS_PORT)
        args.rdzv_endpoint = f"localhost:{port}"
        conf["is_host"] = "true"
    given = {item.partition("=")[0].strip() for item in args.rdzv_conf.split(",") if item.strip()}
    args.rdzv_conf = ",".join(
        [*filter(None, [args.rdzv_conf]), *(f"{key}={value}" for key, value in conf.items() if key not in given)]
    )


def _launch(args: Any) -> None:
    from torch.distributed.run import config_from_args, run

    pod_rendezvous(args)
    store_endpoint = ""
    if not args.standalone and args.rdzv_backend == "c10d" and args.rdzv_endpoint.rpartition(":")[2].isdigit():
        store_endpoint = args.rdzv_endpoint
        os.environ[contract.HANG_STORE] = store_endpoint  # workers started by torchrun inherit it; forked ones: below
        # A hung group's silent ranks on this pod, which no pod-mate answered for, are killed by this launcher.
        hang_store.LauncherKills(
            store_endpoint, os.environ.get(contract.POD_NAME) or os.environ.get("HOSTNAME", "localhost")
        ).start()

    if not (args.module and args.training_script == TRAINER_MODULE and not args.no_python):
        run(args)  # any other program: exactly torchrun
        return
    import multiprocessing
    import uuid

    from torch.distributed.launcher import api as launcher_api

    _plain_torch_log_format()
    if args.standalone:  # as torchrun does it
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload())  # if main did not start it
    with tempfile.TemporaryDirectory(prefix="trainingrun-launch-") as scratch:
        # torch's launch_agent builds the agent by this module-level name: ours refills the restart budget.
        launcher_api.LocalElasticAgent = _progress_aware_agent(  # type: ignore[misc]
            RestartBudget(Path(scratch) / COMMITTED_STEP_FILE, config.max_restarts)
        )
        _rejoining(
            lambda: launcher_api.elastic_launch(config=config, entrypoint=run_trainer_worker)(
                scratch, store_endpoint, *args.training_script_args
            ),
            standalone=args.standalone,
            endpoint=args.rdzv_endpoint,
            timeout=float(config.rdzv_configs.get("read_timeout", 60)),
        )


def _rejoining(launch: Any, standalone: bool, endpoint: str = "", timeout: float = 60.0) -> None:
    """Run `launch` (one elastic agent to its end); when its rendezvous store is lost, start a new agent
    here (a new store connection, a new round) up to REJOINS times, keeping the warm forkserver. Before
    that, wait for the replacement's store to accept connections, polling often: the store client's own
    retries back off to about a second, and every second here is a second of the whole run standing."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    for rejoin in range(REJOINS + 1):
        try:
            launch()
            return
        except RendezvousConnectionError as error:
            if standalone or rejoin == REJOINS:
                raise
            print(
                f"trainingrun launch: rendezvous store lost ({error}); rejoining in this container "
                f"({rejoin + 1}/{REJOINS})",
                file=sys.stderr,
                flush=True,
            )
            _wait_until_listening(endpoint, timeout)


def _wait_until_listening(endpoint: str, timeout: float) -> None:
    """Until `host:port` accepts a TCP connection (or `timeout`; the agent's own connect then reports it).
    Says how long that took and why: the name not resolving yet (the replacement pod has no DNS record
    yet) or nothing listening yet (its agent is still starting)."""
    import socket
    import time

    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return
    started = time.monotonic()
    unresolved = refused = 0
    while time.monotonic() - started < timeout:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except socket.gaierror:
            unresolved += 1
        except OSError:
            refused += 1
        time.sleep(0.05)
    print(
        f"trainingrun launch: waited {time.monotonic() - started:.2f} s for {endpoint} "
        f"({unresolved} lookups found no address, {refused} connections failed)",
        file=sys.stderr,
        flush=True,
    )


def _stop_on_signals() -> None:
    """SIGTERM/SIGINT raise torch's SignalException from the start, as they do once workers run: the
    agent then stops its workers (if any) without closing the rendezvous, and `main` exits 128+signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum: int, _frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        _serve_metrics()  # before any worker or the forkserver starts: they write to its directory
    except MetricsPortTaken as error:
        print(f"trainingrun launch: {error} -> exit {exit_codes.CONFIG_ERROR}", file=sys.stderr, flush=True)
        return exit_codes.CONFIG_ERROR
    start_forkserver(argv)  # before torch is imported here
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args

    _stop_on_signals()
    try:
        _launch(parse_args(argv))
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        codes = [failure.exitcode for failure in error.failures.values()]
        code = container_exit_code(codes)
        print(f"trainingrun launch: worker exit codes {codes} -> exit {code}", file=sys.stderr)
        return code
    except SignalException as error:
        # The agent got SIGTERM/SIGINT itself (pod deletion, Ctrl-C) and has stopped the workers.
        print(f"trainingrun launch: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return 128 + int(error.sigval)
    except (RendezvousError, DistNetworkError, DistStoreError) as error:
        # The rendezvous store went with its host, or a round never completed: not the trainer's fault.
        print(
            f"trainingrun launch: rendezvous lost ({type(error).__name__}: {error}) -> exit "
            f"{exit_codes.RETRYABLE} (retryable: the pod restarts and rejoins)",
            file=sys.stderr,
        )
        return exit_codes.RETRYABLE
    return exit_codes.OK


if __name__ == "__main__":
    from .main import exit_now

    # Without the interpreter's teardown, as a worker ends: threads still inside torch's C++ then (the hang store's
    # reconnect when the rendezvous host is gone, the agent's keep-alive) were seen to abort the launcher in CI
    # ("terminate called without an active exception", exit -6 where 138 was chosen).
    exit_now(main())
