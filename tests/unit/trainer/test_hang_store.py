"""hang_store: each pod's launcher kills, when asked, only its own worker that started when the request says; the
request is untrusted."""

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainingrun_trainer import hang_store
from trainingrun_trainer.timekeeping import start_ticks


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def test_a_launcher_kills_only_its_own_worker_started_when_the_request_says(store):
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a child: as a worker is
    try:
        requests = dist.PrefixStore(hang_store.KILL_PREFIX, store())
        kills = hang_store.LauncherKills("unused:0", "pod-1", connect=lambda: requests)
        started = start_ticks(worker.pid)
        requests.set("pod-1", json.dumps([[worker.pid, started + 1], [os.getppid(), start_ticks(os.getppid())]]))
        kills.look(requests)  # a reused pid (another start time) and a process that is not its worker: left alone
        assert kills.killed == [] and worker.poll() is None and not requests.check(["pod-1"])
        requests.set("pod-1", "not json")
        kills.look(requests)
        assert kills.killed == [] and not requests.check(["pod-1"])
        requests.set("pod-2", json.dumps([[worker.pid, started]]))
        kills.look(requests)  # another pod's request
        assert worker.poll() is None
        requests.set("pod-1", json.dumps([[worker.pid, started]]))
        kills.look(requests)
        assert worker.wait(timeout=10) == -signal.SIGKILL and kills.killed == [worker.pid]
    finally:
        worker.kill()
        worker.wait()
