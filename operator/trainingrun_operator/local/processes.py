"""The processes of a local attempt, found through /proc, and the log lines they write."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


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
