"""hangs: when no progress is a hang (warm-up, auto from the step time, long phases), and the watch's exchange
through a real TCPStore: the asking rank diagnoses, every rank that answered exits HUNG, a peer in a long phase
excuses the wait."""

import json
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainingrun_api import exit_codes
from trainingrun_trainer import hang_store, hangs
from trainingrun_trainer.hangs import FLOOR_SECONDS, STEP_FACTOR, WARMUP_STEPS, HangWatch, StepWatch
from trainingrun_trainer.timekeeping import ProcessClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stepped(watch: StepWatch, clock: FakeTime, steps: int, seconds: float) -> None:
    for _ in range(steps):
        clock.now += seconds
        watch.progress(watch.step + 1)


def test_the_watch_arms_only_after_the_first_steps():
    time = FakeTime()
    watch = StepWatch(None, now=time)
    stepped(watch, time, 1, 10_000)  # a first step that compiles for hours is not a hang, nor a typical step
    stepped(watch, time, WARMUP_STEPS - 2, 0.1)
    assert watch.limit() is None and watch.overdue() is None
    stepped(watch, time, 1, 0.1)
    assert watch.limit() == FLOOR_SECONDS


def test_auto_is_ten_typical_steps_but_never_under_the_floor():
    time = FakeTime()
    watch = StepWatch(None, now=time)
    stepped(watch, time, 20, 0.2)
    assert watch.limit() == FLOOR_SECONDS
    stepped(watch, time, 40, 6.0)  # the window holds only recent steps
    assert watch.limit() == pytest.approx(STEP_FACTOR * 6.0)
    time.now += STEP_FACTOR * 6.0 - 1
    assert watch.overdue() is None
    time.now += 1
    assert watch.overdue() == pytest.approx(STEP_FACTOR * 6.0)


def test_a_fixed_timeout_and_off():
    time = FakeTime()
    fixed, off = StepWatch(45, now=time), StepWatch(0, now=time)
    stepped(fixed, time, 5, 0.1)
    stepped(off, time, 5, 0.1)
    assert fixed.limit() == 45
    time.now += 10_000
    assert fixed.overdue() is not None and off.overdue() is None


def test_a_long_phase_is_not_a_hang_and_the_wait_starts_after_it():
    time = FakeTime()
    watch = StepWatch(None, now=time)
    stepped(watch, time, 5, 0.1)
    with watch.pausing("checkpoint"):
        time.now += 500
        assert watch.phase() == "checkpoint" and watch.overdue() is None
    assert watch.overdue() is None  # the save took 500 s; the wait for the next step starts now
    time.now += FLOOR_SECONDS
    assert watch.overdue() == pytest.approx(FLOOR_SECONDS)


def test_a_long_phase_stuck_in_a_collective_is_no_excuse():
    time, waiting_in_collective = FakeTime(), [0.0]
    watch = StepWatch(None, now=time, collective_age=lambda: waiting_in_collective[0])
    stepped(watch, time, 5, 0.1)
    with watch.pausing("checkpoint"):
        time.now += 500
        assert watch.overdue() is None  # writing to slow storage: its own work, however long
        waiting_in_collective[0] = FLOOR_SECONDS  # the save waits in a collective for a peer that stopped
        assert watch.phase() == "" and watch.overdue() == pytest.approx(500)


def test_the_process_clocks_phases_count_as_long_phases():
    time = FakeTime()
    watch = StepWatch(None, now=time)
    watch.clock = ProcessClock("pod", now=time)
    stepped(watch, time, 5, 0.1)
    with watch.clock.timing("eval"):
        time.now += 300
        assert watch.phase() == "eval" and watch.overdue() is None
    assert watch.overdue() is None
    with watch.clock.timing("data_wait"):  # not a long phase: a data loader that blocks is a hang
        time.now += FLOOR_SECONDS
        assert watch.overdue() is not None


def test_a_step_after_a_save_is_timed_from_the_save_s_end():
    time = FakeTime()
    watch = StepWatch(None, now=time)
    stepped(watch, time, 5, 1.0)
    with watch.pausing("checkpoint"):
        time.now += 100
    stepped(watch, time, 1, 1.0)
    assert max(watch.step_seconds) == pytest.approx(1.0)


def test_thread_frames_name_where_a_thread_waits():
    inside, release = threading.Event(), threading.Event()

    def blocked_in_the_data_loader() -> None:
        inside.set()
        release.wait()

    thread = threading.Thread(target=blocked_in_the_data_loader)
    thread.start()
    try:
        assert inside.wait(10)
        frames = hangs.thread_frames(thread.ident)
        assert frames and frames[-1].endswith("in blocked_in_the_data_loader")  # threading's own wait left out
        assert "test_hangs.py" in frames[-1]
    finally:
        release.set()
        thread.join()


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield lambda: dist.PrefixStore(
        "t", dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    )


def make(rank: int, store, time: FakeTime, exits: list, world: int = 2) -> HangWatch:
    watch = StepWatch(None, now=time)
    stepped(watch, time, 5, 0.1)
    hang_watch = HangWatch(
        watch,
        rank=rank,
        world_size=world,
        pod="pod-0",
        node="node-0",
        store=store(),
        exit=lambda code: exits.append((rank, code)),
    )
    hang_watch.start = lambda: None  # type: ignore[method-assign] # the test drives `check` itself
    store().set(f"identity/{rank}", f'["pod-{rank}", "node-{rank}", 0, 0]')
    return hang_watch


@pytest.mark.slow
def test_the_asking_rank_diagnoses_and_every_answering_rank_exits_hung(store, monkeypatch):
    monkeypatch.setattr(hangs, "EXCHANGE_SECONDS", 5.0)
    time, exits = FakeTime(), []
    first, second = make(0, store, time, exits), make(1, store, time, exits)
    time.now += FLOOR_SECONDS + 1
    answered: list = []
    asking = first.check()  # rank 1 has not looked yet: rank 0 waits for its answer
    assert asking is None or asking == "hang"
    # (rank 0 waited the whole exchange and found rank 1 silent, or rank 1 answered; here it did not look)
    assert exits == [(0, exit_codes.HUNG)]
    assert first.diagnosis is not None and first.diagnosis.waited_for == (1,)
    assert "rank 1 (pod pod-1, node node-1)" in first.diagnosis.summary and "did not answer" in first.diagnosis.summary
    answered.append(second.check())  # it looks later: the verdict is there, and it exits too
    assert exits[-1] == (1, exit_codes.HUNG)


def test_both_answer_and_the_verdict_reaches_the_other(store, monkeypatch):
    monkeypatch.setattr(hangs, "EXCHANGE_SECONDS", 10.0)
    time, exits = FakeTime(), []
    first, second = make(0, store, time, exits), make(1, store, time, exits)
    second.watch.timeout = 10_000  # rank 1 would not find it itself: it answers rank 0's question
    time.now += FLOOR_SECONDS + 1
    results: dict = {}
    answering = threading.Thread(target=lambda: results.setdefault(1, _when_asked(second)))
    answering.start()
    results[0] = first.check()
    answering.join(30)
    assert results == {0: "hang", 1: "hang"}
    assert sorted(exits) == [(0, exit_codes.HUNG), (1, exit_codes.HUNG)]
    assert first.diagnosis is not None
    assert "every rank answered" in first.diagnosis.summary  # no process group here: no flight recorder


def _when_asked(watch: HangWatch) -> str:
    """`check` until rank 0's question is there (the watch's own poll, faster)."""
    while True:
        result = watch.check()
        if result is not None:
            return result
        threading.Event().wait(0.05)


def test_a_peer_in_a_long_phase_is_not_a_hang(store, monkeypatch):
    monkeypatch.setattr(hangs, "EXCHANGE_SECONDS", 10.0)
    time, exits = FakeTime(), []
    first, second = make(0, store, time, exits), make(1, store, time, exits)
    time.now += FLOOR_SECONDS + 1
    results: dict = {}
    with second.watch.pausing("checkpoint"):  # rank 1 writes a long save; rank 0 waits for it in a collective
        answering = threading.Thread(target=lambda: results.setdefault(1, _when_asked(second)))
        answering.start()
        results[0] = first.check()
        answering.join(30)
    assert results == {0: "busy", 1: "busy"} and exits == []
    assert first.round == second.round == 1
    assert first.watch.overdue() is None  # a whole limit again


@pytest.mark.slow
def test_the_asking_rank_asks_another_pods_launcher_to_kill_its_silent_rank(store, monkeypatch):
    monkeypatch.setattr(hangs, "EXCHANGE_SECONDS", 1.0)
    time, exits = FakeTime(), []
    first = make(0, store, time, exits)
    first.launchers = dist.PrefixStore(hang_store.KILL_PREFIX, store())
    store().set("identity/1", '["pod-1", "node-1", 4242, 777]')  # rank 1, on another pod, never answers
    time.now += FLOOR_SECONDS + 1
    assert first.check() == "hang"
    assert json.loads(first.launchers.get("pod-1")) == [[4242, 777]]
    assert not first.launchers.check(["pod-0"])  # its own pod's silent ranks it kills itself


NCCL_RECORDER = """
import json, sys, torch, torch.distributed as dist
from trainingrun_trainer import hang_store, hangs
hangs.enable_flight_recorder()
store = dist.FileStore(sys.argv[1], 1)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
tensor = torch.ones(3, device="cuda")
for _ in range(3):
    dist.all_reduce(tensor)
torch.cuda.synchronize()
groups, in_flight, answered = hangs.flight_recorder()
print(json.dumps([answered, {name: [g.enqueued, g.completed] for name, g in groups.items()}, len(in_flight)]))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py runs it)")
def test_an_nccl_groups_collectives_are_read_from_torchs_flight_recorder(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", NCCL_RECORDER, str(tmp_path / "store")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answered, groups, in_flight = json.loads(done.stdout.strip().splitlines()[-1])
    assert answered, done.stdout  # NCCL's recorder answers where a hang would ask it
    enqueued, completed = groups.get("0", [-1, -2])
    assert enqueued >= 3 and completed == enqueued, (
        done.stdout
    )  # the three all-reduces, completed, on the default group
    assert in_flight == 0
