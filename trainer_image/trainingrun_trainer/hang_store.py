"""The store the hang watch talks through, outside the process group that hangs (hangs.py): which store (the
rendezvous store its host pod's agent serves), the key of one worker group in it, and the launcher's side: each pod's
launcher kills the ranks of its pod that did not answer, when the asking rank asks it to (`LauncherKills`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import uuid
from datetime import timedelta
from typing import Any, Callable, Optional

from trainingrun_api import contract

from .timekeeping import parent_pid, start_ticks

#: How long one wait of a launcher for a request to kill lasts, in the store's server (nothing is sent meanwhile).
WAIT_SECONDS = 30.0
#: Seconds before a launcher connects again to a store that was not up yet or went with its host.
RECONNECT_SECONDS = 5.0

#: Seconds a store operation of the hang watch may take (a store whose host is frozen does not answer).
STORE_TIMEOUT_SECONDS = 10
#: Below the hang store's root: per pod, the worker processes its launcher is asked to kill ([[pid, start], ...]).
KILL_PREFIX = "trainingrun/hang-kill"
#: The most processes one request names (a pod's workers).
MAX_KILLS = 64


class LauncherKills:
    """The launcher's side of `HangWatch._ask_launchers_to_kill`: a thread that waits in the hang store for this pod's
    key and SIGKILLs each named process that is its own worker (a descendant of this process) and started when the
    request says (pid and start time name one process; a pid is reused). The request is untrusted: anything else it
    names is left alone. It waits (the store's server answers when the key is set) rather than polls: a kill then
    comes at once, and a thousand pods do not send the rendezvous store a thousand requests a second."""

    def __init__(self, endpoint: str, pod: str, connect: Optional[Callable[[], Any]] = None):
        self.endpoint, self.pod = endpoint, pod
        self._connect = connect or self._tcp_store
        self._stop = threading.Event()
        self.killed: list[int] = []  #: pids killed so far

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="trainingrun-hang-kills", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def _tcp_store(self) -> Any:
        import torch.distributed as dist

        host, _, port = self.endpoint.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS))
        return dist.PrefixStore(KILL_PREFIX, store)

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                store = store or self._connect()
                if self.asked(store):
                    self.look(store)
            except Exception:  # the store is not up yet, or went with its host: connect again later
                store = None
                self._stop.wait(RECONNECT_SECONDS)

    def asked(self, store: Any, seconds: float = WAIT_SECONDS) -> bool:
        """Whether this pod's key is set within `seconds` (waiting in the store's server); raises when the store is
        gone (a lost connection fails the wait and the check after it alike)."""
        try:
            store.wait([self.pod], timedelta(seconds=seconds))
            return True
        except Exception:  # timed out, or the store is gone: the check tells them apart
            store.check([self.pod])
            return False

    def look(self, store: Any) -> None:
        """One look at this pod's key: kill what it names that may be killed, and clear it."""
        if not store.check([self.pod]):
            return
        raw = store.get(self.pod)
        store.delete_key(self.pod)
        try:
            asked = [(int(pid), int(started)) for pid, started in json.loads(raw[:4096])[:MAX_KILLS]]
        except (ValueError, TypeError):
            return
        for pid, started in asked:
            if pid > 1 and started and start_ticks(pid) == started and _descends_from(pid, os.getpid()):
                print(
                    f"trainingrun launch: worker pid {pid} did not answer a hang: killing it so that the worker group "
                    "restarts now",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                except OSError:
                    pass


def _descends_from(pid: int, ancestor: int, depth: int = 4) -> bool:
    """Whether `ancestor` is `pid`'s parent, or its parent's, within `depth` generations (/proc)."""
    for _ in range(depth):
        pid = parent_pid(pid)
        if pid in (0, ancestor):
            return pid == ancestor
    return False


def group_key(process_group: Any = None) -> Optional[str]:
    """A key the ranks of this worker group share and no other group has: rank 0's random one, broadcast over the
    process group once (collective: every rank calls it, as every rank builds its `Run`). Not the restart count,
    which differs between pods (an agent restarted because a peer failed counts nothing), nor the store's port alone,
    which a later round may get again. `process_group`: a gloo group to broadcast over (with NCCL, the host's);
    None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=process_group)
    return str(box[0])


def shared_store() -> Any:
    """A store every rank of this worker group reaches outside the process group (a connection of its own: the
    group's may be what hangs): the rendezvous store its host pod's agent serves (contract.HANG_STORE), which a
    frozen worker cannot take down, and each pod's launcher reads (`LauncherKills`); else the workers' own
    (MASTER_ADDR: torchrun's agent's, or rank 0's process's). None outside torchrun."""
    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    import torch.distributed as dist

    host, _, port = env.get(contract.HANG_STORE, "").rpartition(":")
    if not (host and port.isdigit()):
        host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
    timeout = timedelta(seconds=STORE_TIMEOUT_SECONDS)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
