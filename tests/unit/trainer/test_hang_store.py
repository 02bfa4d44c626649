"""hang_store: each pod's launcher kills, when asked, only its own worker that started when the request says; the
request is untrusted."""

import json
import os
import signal
import subprocess
import sys
import threading
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


class Recording:
    """A store that records the launcher's calls, and says when it first waits."""

    def __init__(self, store):
        self.store, self.calls, self.waiting = store, [], threading.Event()

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "wait":
                self.waiting.set()
            return getattr(self.store, name)(*args)

        return call


def test_a_launcher_waits_in_the_store_and_kills_as_soon_as_asked_without_polling(store):
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        recording = Recording(dist.PrefixStore(hang_store.KILL_PREFIX, store()))
        kills = hang_store.LauncherKills("unused:0", "pod-1", connect=lambda: recording)
        kills.start()
        assert recording.waiting.wait(timeout=30)
        asking = dist.PrefixStore(hang_store.KILL_PREFIX, store())
        asking.set("pod-1", json.dumps([[worker.pid, start_ticks(worker.pid)]]))
        # Well within one WAIT_SECONDS: the store's answer to the wait woke it, not a timeout.
        assert worker.wait(timeout=hang_store.WAIT_SECONDS / 2) == -signal.SIGKILL
        kills.stop()
        assert recording.calls[:4] == ["wait", "check", "get", "delete_key"]  # one request while nothing was asked
    finally:
        worker.kill()
        worker.wait()


def test_a_wait_that_times_out_is_not_a_request_and_a_lost_store_raises():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    kills = hang_store.LauncherKills("unused:0", "pod-1", connect=lambda: client)
    assert not kills.asked(client, seconds=0.2)
    server.set("pod-1", "[]")
    assert kills.asked(client, seconds=0.2)
    del server  # the rendezvous host's agent gone
    with pytest.raises(dist.DistError):
        kills.asked(client, seconds=0.2)
