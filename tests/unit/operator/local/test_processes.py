"""local.processes: the log follower returns each complete line once, and nothing before the file exists."""

from trainingrun_operator import local


def test_log_follower_returns_each_complete_line_once(tmp_path):
    path = tmp_path / "attempt-1.log"
    follower = local.LogFollower(path)
    assert follower.new_lines() == []  # not created yet
    path.write_text("one\ntw")
    assert follower.new_lines() == ["one"]
    with open(path, "a") as f:
        f.write("o\nthree\n")
    assert follower.new_lines() == ["two", "three"]
    assert follower.new_lines() == []


def test_orphaned_semaphores_are_removed_and_those_in_use_or_out_of_the_window_kept():
    """What a SIGKILLed resource tracker leaves: a named semaphore no process maps. One this process holds open is in
    use; one made before the window (another run's) is not this run's to remove."""
    import _multiprocessing
    import os
    import time
    import uuid

    from trainingrun_operator.local import processes

    began = time.time() - 1  # /dev/shm's clock may lag time.time() by a tick
    tag = uuid.uuid4().hex[:8]

    def semaphore(name: str):
        return _multiprocessing.SemLock(1, 1, 1, f"/mp-{tag}-{name}", False)  # named and not unlinked, as spawn's

    def path(name: str) -> str:
        return os.path.join(processes.SEMAPHORE_DIR, f"sem.mp-{tag}-{name}")

    orphan, in_use, older = semaphore("orphan"), semaphore("in-use"), semaphore("older")
    del orphan, older  # closed: unmapped, as by a process that is gone
    os.utime(path("older"), (began - 60, began - 60))
    try:
        removed = processes.remove_orphaned_semaphores(made_before=time.time() + 1, made_after=began)
        assert f"sem.mp-{tag}-orphan" in removed
        assert not os.path.exists(path("orphan"))
        assert os.path.exists(path("in-use")) and os.path.exists(path("older"))
        assert in_use.acquire(False)  # still a working semaphore
    finally:
        for name in ("orphan", "in-use", "older"):
            if os.path.exists(path(name)):
                os.remove(path(name))


def test_after_a_lost_node_only_the_semaphores_its_processes_mapped_are_removed():
    """Issue 77 item 8: a process in another PID namespace that shares /dev/shm (same uid) maps its semaphores where
    this one cannot see: on main its live semaphore, made in the run's window and mapped by no visible process, was
    removed as an orphan. Now what the lost node's processes mapped is recorded before they are killed, and only that
    goes. (The other namespace is played by a semaphore this process closed: from here, mapped by nobody.)"""
    import _multiprocessing
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from trainingrun_operator.local import processes

    began = time.time() - 1
    tag = uuid.uuid4().hex[:8]
    lost_name, foreign_name = f"sem.mp-{tag}-lost", f"sem.mp-{tag}-foreign"
    node = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import _multiprocessing, sys; s = _multiprocessing.SemLock(1, 1, 1, '/mp-{tag}-lost', False); "
            "print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    foreign = _multiprocessing.SemLock(1, 1, 1, f"/mp-{tag}-foreign", False)
    del foreign  # unmapped here: as another namespace's live semaphore looks from this one
    try:
        assert node.stdout.readline() == b"ready\n"
        recorded = processes.semaphores_mapped([node.pid])
        assert len(recorded) == 1
        os.killpg(node.pid, signal.SIGKILL)  # the node lost: its resource tracker would have gone with it
        node.wait()
        removed = processes.remove_orphaned_semaphores(made_before=time.time() + 1, made_after=began, only=recorded)
        assert removed == [lost_name]
        assert os.path.exists(os.path.join(processes.SEMAPHORE_DIR, foreign_name))
    finally:
        for name in (lost_name, foreign_name):
            path = os.path.join(processes.SEMAPHORE_DIR, name)
            if os.path.exists(path):
                os.remove(path)
