"""The container entry point maps worker exit codes so PyTorchJob's ExitCode policy means what it says."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from environments import inherited
from tiny_runs import tiny_trainer
from trainingrun_api import contract, exit_codes
from trainingrun_trainer.launch import POD_KEEP_ALIVE, RestartBudget, container_exit_code, pod_rendezvous

WORKER = Path(__file__).resolve().parents[2] / "fixtures" / "exit_worker.py"


def test_mapping():
    assert container_exit_code([3, -15]) == 3  # a deliberate permanent error wins over the peers it took down
    assert container_exit_code([-9, 3]) == 3  # even when the agent had to SIGKILL a hung peer
    assert container_exit_code([143, -15]) == 143
    assert container_exit_code([-15]) == 143
    assert container_exit_code([-9, 1]) == 137  # the peer of an OOM-killed worker fails its collective: not permanent
    assert container_exit_code([1, -9]) == 137
    assert container_exit_code([-9, 143]) == 137
    assert container_exit_code([1, -15]) == 1  # an uncaught exception that nothing else explains
    assert container_exit_code([139]) == 139
    assert all(not exit_codes.is_permanent(container_exit_code([c])) for c in (-9, -15, 143, 137))


def launch(**env):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainingrun_trainer.launch",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            str(WORKER),
        ],
        env=full,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "env,expected",
    [
        ({"EXIT_CODE": 0}, 0),
        ({"EXIT_CODE": 3}, 3),
        ({"EXIT_CODE": 143}, 143),
        ({"EXIT_SIGNAL": int(signal.SIGKILL)}, 137),
    ],
    ids=["success", "permanent", "preempted", "killed"],
)
def test_real_agent_exit_codes(env, expected):
    result = launch(**env)
    assert result.returncode == expected, result.stderr[-2000:]


@pytest.mark.slow
def test_built_in_trainer_permanent_exit_is_not_retried_in_place(tmp_path):
    # The built-in trainer runs in forkserver workers; torchrun would restart a bad config
    # --max-restarts times, but the restarted groups exit with the remembered code at once.
    config = tmp_path / "config.yaml"
    trainer = tiny_trainer(model={"classPath": "trainingrun_trainer.models.NoSuchModel"})
    config.write_text(yaml.safe_dump({"trainer": trainer, "checkpoint": {"uri": f"file://{tmp_path}/ckpt"}}))
    env = inherited("TRAININGRUN_")
    env.update({"TRAININGRUN_CONFIG": str(config), "OMP_NUM_THREADS": "1"})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainingrun_trainer.launch",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--module",
            "trainingrun_trainer",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stderr[-3000:]
    # Only the first group ran the trainer (a message per rank that got that far before the agent
    # stopped its peer); the two restarted groups exited with the remembered code at once.
    assert 1 <= result.stderr.count("trainingrun-trainer: spec.trainer.model.classPath") <= 2
    assert result.stderr.count("failed (exitcode: 2)") == 3


def test_a_taken_metrics_port_is_one_line_naming_it_and_a_config_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launch(EXIT_CODE=0, TRAININGRUN_METRICS_PORT=port)
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert result.stderr.strip().splitlines() == [
        f"trainingrun launch: cannot serve metrics on port {port} (TRAININGRUN_METRICS_PORT: spec.metrics.port in a "
        "pod, --metrics-port under trainingrun local): Address already in use; pick a free port, or turn metrics off "
        "(spec.metrics.enabled: false; leave --metrics-port out) -> exit 2"
    ]


@pytest.mark.slow
def test_the_launcher_ends_without_the_interpreters_teardown_so_threads_in_torch_cannot_abort_it(tmp_path):
    """CI once saw a launcher whose rendezvous host was gone abort at its end ("terminate called without an active
    exception", exit -6 where 138 was chosen): its hang-kills thread was still inside torch's TCPStore connect while
    the interpreter tore down. Here the store never answers, so that thread is retrying when `main` returns; the
    container must still exit with the chosen code, and the teardown (whose atexit hooks would run) must not run."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    # Every Python process of the run (the forkserver and workers too) marks its teardown with its pid.
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os\n"
        f"atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, f'teardown-{{os.getpid()}}'), 'w').close())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainingrun_trainer.launch",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.2:{port}",  # not this machine's name: a client of a store that is not there
            "--rdzv-conf=read_timeout=1,is_host=false",
            "--module",
            "trainingrun_trainer",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == exit_codes.RETRYABLE, stderr[-3000:]
    assert "rendezvous lost" in stderr
    assert not (tmp_path / f"teardown-{launcher.pid}").exists()


def agent_args(*argv: str):
    from torch.distributed.run import parse_args

    return parse_args([*argv, "--module", "trainingrun_trainer"])


POD_ENV = {contract.POD_IP: "10.244.0.7", contract.RENDEZVOUS_HOST_POD: "demo-a1-worker-0"}


def conf(args) -> dict:
    return {key.strip(): value for key, _, value in (item.partition("=") for item in args.rdzv_conf.split(","))}


def test_the_rendezvous_host_pod_hosts_the_store_on_its_own_port():
    """Its peers reach it through the run's Service, a name torch's guess (does the endpoint name this machine?)
    never matches: without is_host no pod would host the store and the rendezvous would never complete."""
    args = agent_args("--rdzv-endpoint=demo-rendezvous:23456", "--rdzv-conf=read_timeout=30")
    pod_rendezvous(args, {**POD_ENV, contract.POD_NAME: "demo-a1-worker-0"})
    assert args.rdzv_endpoint == "localhost:23456"
    assert conf(args) == {"read_timeout": "30", "is_host": "true", **POD_KEEP_ALIVE}
    assert args.local_addr == "10.244.0.7"


def test_a_jobset_pod_hosts_the_store_when_its_hostname_is_the_host_pods(monkeypatch):
    """A JobSet's pod is named by its Job with a random suffix; its hostname is the stable one the operator names."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "demo-a1-worker-0-0")
    env = {**POD_ENV, contract.RENDEZVOUS_HOST_POD: "demo-a1-worker-0-0"}
    args = agent_args("--rdzv-endpoint=demo-rendezvous:23456")
    pod_rendezvous(args, {**env, contract.POD_NAME: "demo-a1-worker-0-0-x7k2p"})
    assert args.rdzv_endpoint == "localhost:23456" and conf(args)["is_host"] == "true"
    monkeypatch.setattr(socket, "gethostname", lambda: "demo-a1-worker-0-1")
    peer = agent_args("--rdzv-endpoint=demo-rendezvous:23456")
    pod_rendezvous(peer, {**env, contract.POD_NAME: "demo-a1-worker-0-1-q9d4m"})
    assert peer.rdzv_endpoint == "demo-rendezvous:23456" and "is_host" not in conf(peer)


def test_other_pods_keep_the_service_endpoint_and_give_peers_their_ip():
    args = agent_args("--rdzv-endpoint=demo-rendezvous:23456")
    pod_rendezvous(args, {**POD_ENV, contract.POD_NAME: "demo-a1-worker-1"})
    assert (args.rdzv_endpoint, conf(args), args.local_addr) == ("demo-rendezvous:23456", POD_KEEP_ALIVE, "10.244.0.7")


def test_what_the_user_set_wins_and_outside_a_pod_nothing_changes():
    args = agent_args(
        "--rdzv-endpoint=demo-rendezvous:23456",
        "--local-addr=node-7",
        "--rdzv-conf=keep_alive_interval=10, is_host=false",
    )
    pod_rendezvous(args, {**POD_ENV, contract.POD_NAME: "demo-a1-worker-0"})
    assert args.local_addr == "node-7"
    assert conf(args) == {"keep_alive_interval": "10", "is_host": "false", "keep_alive_max_attempt": "2"}
    for argv, env in [
        (["--standalone"], {**POD_ENV, contract.POD_NAME: "demo-a1-worker-0"}),
        (["--rdzv-endpoint=localhost:29500"], {}),
    ]:
        args = agent_args(*argv)
        pod_rendezvous(args, env)
        assert (args.rdzv_conf, args.local_addr) == ("", None)


class Spec:
    max_restarts = 3


def test_the_restart_budget_refills_only_after_a_newly_committed_step(tmp_path):
    committed = tmp_path / "committed-step"
    budget = RestartBudget(committed, per_attempt=3)
    assert not budget.progressed()  # the group committed nothing yet: a crash loop spends the budget
    committed.write_text("10")
    assert budget.progressed()
    assert not budget.progressed()  # the same step again: no progress since the last failure
    committed.write_text("20")
    assert budget.progressed() and budget.committed == "20"


def test_a_refilled_budget_keeps_the_restart_count_growing():
    # TORCHELASTIC_RESTART_COUNT = spec.max_restarts - remaining: --chaos-kill-step and the start counts read it.
    spec, budget = Spec(), RestartBudget(Path("unused"), per_attempt=3)
    remaining = 1  # two restarts done
    remaining = budget.restore(spec, remaining)
    assert remaining == 3 and spec.max_restarts - remaining == 2
    remaining -= 1  # the agent's own decrement for the restart it is about to do
    assert spec.max_restarts - remaining == 3
