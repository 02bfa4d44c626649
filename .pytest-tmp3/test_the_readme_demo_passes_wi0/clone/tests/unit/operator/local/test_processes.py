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


def _sleeper_with_children(marker: str, children: int) -> str:
    """A script whose command line carries `marker` (as multiprocessing's helpers' do): it starts `children` sleeping
    children, prints their pids and sleeps."""
    return (
        f"# {marker}\nimport subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range({children})]\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\ntime.sleep(60)\n"
    )


def test_the_workers_are_the_forkservers_children_and_the_agents_other_children_but_its_helpers():
    """--chaos-kill-every's victims. On main only the agent's grandchildren counted: under torchrun running a
    command of the user's (its workers are its own children) there were none, and nothing was ever killed."""
    import os
    import signal
    import subprocess
    import sys

    kinds = [
        ("from multiprocessing.forkserver import main", 2),  # our launcher: the workers are forked here
        ("from multiprocessing.resource_tracker import main", 0),  # a helper, never a victim
        ("from multiprocessing.spawn import spawn_main", 1),  # torchrun's own worker, and its data loader's child
    ]
    agent_script = "import subprocess, sys, time\nprocs = []\n"
    for marker, children in kinds:
        child = _sleeper_with_children(marker, children)
        agent_script += (
            f"procs.append(subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True))\n"
        )
    agent_script += (
        "print(';'.join(f'{p.pid}:{p.stdout.readline().strip()}' for p in procs), flush=True)\ntime.sleep(60)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", agent_script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        started = [part.partition(":") for part in agent.stdout.readline().strip().split(";")]
        (_, _, forked), (tracker, _, _), (spawned, _, loader) = started
        workers = sorted(local.worker_pids(agent.pid))
        assert workers == sorted([*map(int, forked.split()), int(spawned)])
        assert int(tracker) not in workers and int(loader) not in workers
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
