"""The processes of a local attempt: how each simulated node's launcher is started (its command, torchrun's settings,
its rendezvous) and ended, found through /proc and by its tag, and the log lines they write."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Optional

from .. import api, builders


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
    """The training processes of a node's launcher (torchrun's agent): the children of its forkserver (our launcher
    forks its workers there) and its other children but multiprocessing's resource tracker (torchrun itself, running
    a command of the user's, spawns them), never a data loader's worker, which is a worker's child."""
    workers = []
    for child in child_pids(agent_pid):
        started_as = _command_line(child)
        if b"multiprocessing.forkserver" in started_as:
            workers += child_pids(child)
        elif b"multiprocessing.resource_tracker" not in started_as:
            workers.append(child)
    return workers


def _command_line(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


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


def wait_for_tagged_to_end(tag: str, timeout: float = 5.0) -> bool:
    """Wait (up to `timeout` seconds) until no process carrying `tag` (`tagged`) is left; whether none is."""
    deadline = time.monotonic() + timeout
    while tagged(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _end_session(launcher: subprocess.Popen, tag: str) -> None:
    """Kill what is left of an attempt's processes once its launcher has exited: they share its process group
    (start_new_session), and the forkserver or a worker would otherwise outlive `trainingrun local`; and every
    process carrying `tag` (`tagged`): torchrun starts the workers of a script of one's own in sessions of their
    own, outside the launcher's group, and a lost node's stopped worker outlived it and held its peers up."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


#: The variable every process of one local node inherits (`Launcher.start`), by which its processes are found
#: wherever they are in the process tree.
PROCESS_TAG = "TRAININGRUN_LOCAL_PROCESS_TAG"


def tagged(tag: str) -> list[int]:
    """This user's processes whose environment carries PROCESS_TAG=`tag`."""
    marker = f"{PROCESS_TAG}={tag}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes() + b"\0":
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


#: Where Linux keeps POSIX named semaphores (sem_open): multiprocessing's are "sem.mp-<random>".
SEMAPHORE_DIR = "/dev/shm"


Mapping = tuple[str, int]  #: (device as /proc/<pid>/maps writes it, inode) of a mapped file


def semaphores_mapped(pids: Optional[Collection[int]] = None) -> set[Mapping]:
    """The named semaphores (`SEMAPHORE_DIR`) mapped by the processes `pids`, or by every process this user can see
    (None). sem_open maps a file it made under a temporary name and then links to the semaphore's: the maps name that
    (deleted); the inode is the semaphore's."""
    mapped: set[Mapping] = set()
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            if pids is not None and int(process.name) not in pids:
                continue
            maps = (process / "maps").read_text()
        except OSError:  # gone meanwhile, or another user's (which cannot map this user's 0600 semaphores)
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(SEMAPHORE_DIR + "/"):
                mapped.add((fields[3], int(fields[4])))
    return mapped


def remove_orphaned_semaphores(
    made_before: float, made_after: float = 0.0, only: Optional[Collection[Mapping]] = None
) -> list[str]:
    """Remove this user's multiprocessing semaphores (`SEMAPHORE_DIR`/sem.mp-*) last changed between `made_after` and
    `made_before` (time.time()) that no live process maps; the names removed. Processes of the spawn and forkserver
    start methods (the data loader's workers, torch.multiprocessing) leave their unlinking to a resource tracker, and a
    node lost at once (--chaos-lose-node: the tracker SIGKILLed with the rest) leaves them in this machine's /dev/shm,
    where a pod's went with the pod. A semaphore that some process maps is in use and is kept. `only`: just those the
    lost processes mapped (`semaphores_mapped`, before they were killed): a process in another PID namespace that
    shares /dev/shm maps its semaphores where this one cannot see, and its live ones looked orphaned."""
    try:
        named = [
            (entry, entry.stat(follow_symlinks=False))
            for entry in os.scandir(SEMAPHORE_DIR)
            if entry.name.startswith("sem.mp-") and entry.is_file(follow_symlinks=False)
        ]
    except OSError:
        return []
    uid = os.getuid()
    candidates = [
        (entry, status, (f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}", status.st_ino))
        for entry, status in named
        if status.st_uid == uid and made_after <= status.st_mtime < made_before
    ]
    if only is not None:
        candidates = [candidate for candidate in candidates if candidate[2] in only]
    if not candidates:
        return []
    mapped = semaphores_mapped()
    removed = []
    for entry, _, identity in candidates:
        if identity not in mapped:
            try:
                os.remove(entry.path)
            except OSError:
                continue
            removed.append(entry.name)
    return removed


@dataclass
class Launcher:
    """One node's launcher process (one pod of the PyTorchJob in a cluster), its workers in its process group."""

    node: int
    process: subprocess.Popen
    log: LogFollower
    command: list[str]
    env: dict[str, str]

    @classmethod
    def start(cls, node: int, command: list[str], env: dict[str, str], log_path: Path) -> "Launcher":
        env = {**env, PROCESS_TAG: uuid.uuid4().hex}  # found by it wherever torchrun puts them (`tagged`)
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(node, process, LogFollower(log_path), command, env)

    def processes(self) -> list[int]:
        """Every process of this node still alive, wherever it is in the process tree."""
        return tagged(self.env[PROCESS_TAG])

    def close(self) -> None:
        """Its processes gone, the launcher's included (reaped)."""
        _end_session(self.process, self.env[PROCESS_TAG])
        self.process.wait()


def own_command(spec: api.TrainingRunSpec) -> Optional[list[str]]:
    """The spec's own `command` and `args` (None: the built-in trainer), as this machine runs them: `python` is this
    Python and `torchrun` its torch.distributed.run, where a pod runs its image's."""
    if spec.command is None and spec.args is None:
        return None
    command = [*(spec.command or builders.DEFAULT_COMMAND), *(spec.args or [])]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    if command[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    return command


def as_pet_variables(options: list[str]) -> dict[str, str]:
    """torchrun's `--name=value` options (and `--flag`s) as the PET_NAME variables it reads when an option is not
    given."""
    pairs = (option.lstrip("-").partition("=") for option in options)
    return {f"PET_{name.replace('-', '_').upper()}": value if equals else "1" for name, equals, value in pairs}


def node_rendezvous(nodes: int, node: int, port: int, rendezvous_id: str) -> list[str]:
    """torchrun's rendezvous arguments for simulated node `node` of `nodes` on this machine: c10d on 127.0.0.1:`port`,
    hosted by node 0."""
    rendezvous = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    rendezvous.append(f"--rdzv-id={rendezvous_id}")
    if node:  # 127.0.0.1 is every node's own address here: only node 0 may take the store's port
        rendezvous.append("--rdzv-conf=is_host=false")
    return rendezvous


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def inductor_cache() -> str:
    """torch's default TORCHINDUCTOR_CACHE_DIR (torch._inductor.runtime.cache_dir_utils), without importing torch."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
