"""checkpoint/save_planner.py: a store plans once while its state keeps its layout, and afresh when it changes."""

import json
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, make_model, train_step
from test_checkpoint_persisting import behind as persisting_behind
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainingrun_trainer.checkpoint import (
    CheckpointStore,
    DigestOfEntry,
    committing,
    memory_tier,
    model_digest,
    save_planner,
)
from trainingrun_trainer.checkpoint.save_planner import ReusingSavePlanner, SameResults, layout

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def plans_built(monkeypatch):
    """How many local plans DCP's planner built from scratch."""
    built = []
    original = DefaultSavePlanner.create_local_plan

    def counting(self):
        built.append(1)
        return original(self)

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", counting)
    return built


def loaded(store, step, like):
    target = {key: {name: torch.zeros_like(t) for name, t in value.items()} for key, value in like.items()}
    store.load(next(i for i in store.list() if i.step == step), target)
    return target


def test_an_unchanged_layout_is_planned_once_and_a_changed_one_again(tmp_path, plans_built):
    with CheckpointStore(f"file://{tmp_path}/a") as store:
        for step in (1, 2, 3):  # the same layout, new values
            store.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"step": step}, blocking=True)
        assert len(plans_built) == 1
        grown = {"model": {"w": torch.full((3,), 4.0), "b": torch.ones(2)}}
        store.save(4, grown, {"step": 4}, blocking=True)
        assert len(plans_built) == 2  # a new entry: planned again, and written
        reshaped = {"model": {"w": torch.full((5,), 5.0), "b": torch.ones(2)}}
        store.save(5, reshaped, {"step": 5}, blocking=True)
        assert len(plans_built) == 3
        assert loaded(store, 3, {"model": {"w": torch.zeros(3)}})["model"]["w"].tolist() == [3.0] * 3
        assert loaded(store, 4, grown)["model"]["b"].tolist() == [1.0, 1.0]
        assert loaded(store, 5, reshaped)["model"]["w"].tolist() == [5.0] * 5
        key = store.committer.plans_key
    assert not any(key in getattr(SavePlanner, name) for name in ("_cached_save_plan", "_cached_metadata"))


def test_two_stores_in_one_process_keep_their_own_plans(tmp_path):
    with CheckpointStore(f"file://{tmp_path}/a") as one, CheckpointStore(f"file://{tmp_path}/b") as two:
        one.save(1, {"model": {"w": torch.ones(3)}}, blocking=True)
        two.save(1, {"model": {"v": torch.ones(4)}}, blocking=True)
        one.save(2, {"model": {"w": torch.full((3,), 2.0)}}, blocking=True)
        assert loaded(one, 2, {"model": {"w": torch.zeros(3)}})["model"]["w"].tolist() == [2.0] * 3
        assert loaded(two, 1, {"model": {"v": torch.zeros(4)}})["model"]["v"].tolist() == [1.0] * 4


def test_the_layout_is_what_a_plan_depends_on_and_only_plain_tensors_and_values_have_one():
    base = layout({"w": torch.zeros(2, 3), "extra": b"x"})
    assert base == layout({"w": torch.ones(2, 3), "extra": b"longer"})  # values do not matter
    assert base != layout({"w": torch.zeros(3, 2), "extra": b"x"})
    assert base != layout({"w": torch.zeros(2, 3, dtype=torch.float16), "extra": b"x"})
    # A staged copy never requires grad and may lie in pinned pages: the live state's layout is the staged one's.
    assert base == layout({"w": torch.nn.Parameter(torch.zeros(2, 3)), "extra": b"x"})
    assert base == layout({"w": torch.zeros(2, 3, device="meta"), "extra": b"x"})

    class Subclass(torch.Tensor):  # DTensor and other subclasses plan themselves
        pass

    assert layout({"w": torch.zeros(2).as_subclass(Subclass)}) is None


@pytest.fixture
def dcp_saves(monkeypatch):
    """How many saves went through dcp.save (planning with every rank) rather than by the last plan."""
    calls = []
    original = committing.dcp.save

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(committing.dcp, "save", counting)
    return calls


def behind(tmp_path) -> CheckpointStore:
    return persisting_behind(tmp_path / "bucket", tmp_path / "shm" / "tier")


def test_saves_of_an_unchanged_layout_to_memory_are_written_by_the_last_plan_and_load_from_either_tier(
    tmp_path, dcp_saves, monkeypatch
):
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", 0.0)  # the test's tmp_path is not node memory
    with behind(tmp_path) as store:
        for step in (1, 2, 3):
            store.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"step": step}, blocking=True)
        assert len(dcp_saves) == 1
        grown = {"model": {"w": torch.full((3,), 4.0), "b": torch.ones(2)}}
        store.save(4, grown, {"step": 4}, blocking=True)
        assert len(dcp_saves) == 2  # a new entry: planned with every rank again
        store.save(5, {"model": {"w": torch.full((3,), 5.0), "b": torch.full((2,), 5.0)}}, {"step": 5}, blocking=True)
        assert len(dcp_saves) == 2
        store.wait_persisted()
    # Every file of the newest step, the metadata too, is in its manifest and verifies, in storage and in memory.
    storage = CheckpointStore(f"file://{tmp_path}/bucket")
    newest = storage.list(verify=True)[0]
    assert newest.step == 5 and newest.valid and ".metadata" in newest.files
    with behind(tmp_path) as restart:
        target = {"model": {"w": torch.zeros(3), "b": torch.zeros(2)}}
        assert restart.load(restart.latest_valid(), target) == {"step": 5}
        assert restart.metrics.last_restore_source == "memory"
    assert target["model"]["w"].tolist() == [5.0] * 3 and target["model"]["b"].tolist() == [5.0] * 2
    target = {"model": {"w": torch.zeros(3), "b": torch.zeros(2)}}
    assert storage.load(newest, target) == {"step": 5}  # a new pod
    assert target["model"]["w"].tolist() == [5.0] * 3 and target["model"]["b"].tolist() == [5.0] * 2


def test_metadata_that_cannot_be_written_fails_that_save_only(tmp_path, dcp_saves, monkeypatch, caplog):
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", 0.0)
    finish = ReusingSavePlanner.finish_as_planned
    fail_once = [OSError("No space left on device")]

    def failing(self, writer, results):
        if fail_once:
            raise fail_once.pop()
        finish(self, writer, results)

    monkeypatch.setattr(ReusingSavePlanner, "finish_as_planned", failing)
    with behind(tmp_path) as store, caplog.at_level(logging.ERROR, logger="trainingrun.checkpoint"):
        store.save(1, {"model": {"w": torch.ones(3)}}, blocking=True)
        store.save(2, {"model": {"w": torch.full((3,), 2.0)}}, blocking=True)
        assert store.metrics.failed_saves == 1 and store.in_memory.step == 1
        assert "No space left on device" in caplog.text
        store.save(3, {"model": {"w": torch.full((3,), 3.0)}}, blocking=True)
        assert store.metrics.failed_saves == 1 and store.in_memory.step == 3
        target = {"model": {"w": torch.zeros(3)}}
        store.load(store.latest_valid(), target)
    assert target["model"]["w"].tolist() == [3.0] * 3
    assert len(dcp_saves) == 1


def test_a_save_with_the_last_write_results_refers_to_them_and_writes_the_last_metadata_bytes(tmp_path, monkeypatch):
    """Write results equal to the last committed save's are sent as `SameResults`, and the metadata is pickled again
    only when what it stores changed (here: the extra's bytes grow); every checkpoint loads its own values."""
    monkeypatch.setattr(memory_tier, "RESERVE_SHARE", 0.0)
    pickled, sent = [], []
    monkeypatch.setattr(
        save_planner, "pickle", SimpleNamespace(dumps=lambda obj: pickled.append(1) or pickle.dumps(obj))
    )
    to_send = ReusingSavePlanner.results_to_send
    monkeypatch.setattr(
        ReusingSavePlanner, "results_to_send", lambda self, results: sent.append(to_send(self, results)) or sent[-1]
    )
    notes = {1: "a", 2: "a", 3: "b", 4: "b", 5: "c" * 1000, 6: "d" * 1000}
    uri = (tmp_path / "bucket").as_uri()
    with CheckpointStore(uri, memory_tier=str(tmp_path / "tier"), persist_behind=True, keep=10) as store:
        for step, note in notes.items():
            store.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"note": note}, blocking=True)
            store.wait_persisted()  # else a newer memory checkpoint may supersede this one's upload (newest wins)
    # 1 is planned by DCP; 2 sends its results; 3 and 4 refer to them (a note of the same length lies where it did);
    # 5's longer note moves what follows it: new results and new metadata; 6 refers to 5's.
    assert [type(s).__name__ for s in sent] == ["list", "SameResults", "SameResults", "list", "SameResults"]
    assert len(pickled) == 2
    storage = CheckpointStore(uri)
    for info in storage.list(verify=True):
        target = {"model": {"w": torch.zeros(3)}}
        assert info.valid and storage.load(info, target) == {"note": notes[info.step]}
        assert target["model"]["w"].tolist() == [float(info.step)] * 3
    assert sorted(info.step for info in storage.list()) == list(notes)


def test_results_are_referred_to_only_while_both_sides_hold_those_of_the_last_committed_save():
    planner = ReusingSavePlanner("test-results", {})
    first, second = [object()], [object()]
    assert planner.results_to_send(first) is first  # nothing committed yet
    planner.committed(4, first, [first, second])
    assert planner.results_to_send(list(first)) == SameResults(4)
    assert planner.results_received(1, SameResults(4)) is second
    assert planner.results_received(1, second) is second
    with pytest.raises(LookupError, match="step 3"):
        planner.results_received(1, SameResults(3))
    planner.not_committed()  # a failed save: neither side refers to older results
    assert planner.results_to_send(first) is first
    with pytest.raises(LookupError, match="rank 0 does not hold"):
        planner.results_received(1, SameResults(4))


def on_two_ranks(worker, tmp_path) -> str:
    """Run `worker(rank, init_file, uri, tier, out_dir)` on 2 gloo ranks sharing one node's memory tier; the uri."""
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(
        worker,
        args=(str(tmp_path / "pg-store"), uri, str(tmp_path / "node" / "tier"), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    return uri


def _repeating_worker(rank: int, init_file: str, uri: str, tier: str, out_dir: str) -> None:
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    saves = []
    original = committing.dcp.save
    committing.dcp.save = lambda *args, **kwargs: saves.append(1) or original(*args, **kwargs)
    try:
        model = make_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True, keep=10) as store:
            for step in (1, 2, 3):
                train_step(model, opt, seed=step)
                store.save(step, app_state(model, opt), {"rank": rank, "step": step})
                assert store.wait() is not None
            expected = model_digest(model.state_dict())
        restored = {}
        for memory in (tier, None):  # a restart in place, then a new pod
            fresh = make_model(1)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            state = app_state(fresh, fresh_opt)
            with CheckpointStore(uri, memory_tier=memory, persist_behind=True) as store:
                extra = store.load(store.latest_valid(), state)
                restored[store.metrics.last_restore_source] = [extra, model_digest(state["model"])]
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"saves": len(saves), "expected": expected, "restored": restored})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_write_repeated_saves_by_their_last_plans(tmp_path):
    """After the first save, every rank writes by its last plan and rank 0 writes the metadata from the results it
    gathers: both ranks restore their own extra state and the newest weights from memory and from storage."""
    uri = on_two_ranks(_repeating_worker, tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["saves"] for r in results] == [1, 1]
    for rank, result in enumerate(results):
        assert set(result["restored"]) == {"memory", "storage"}
        for extra, digest in result["restored"].values():
            assert extra == {"rank": rank, "step": 3}
            assert digest == result["expected"]
    assert CheckpointStore(uri).list(verify=True)[0].valid


def _staging_worker(rank: int, init_file: str, uri: str, tier: str, out_dir: str) -> None:
    memory_tier.RESERVE_SHARE = 0.0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # replicated weights, as DDP keeps them
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with CheckpointStore(uri, memory_tier=tier, persist_behind=True, keep=10) as store:
            for step in (1, 2, 3):
                train_step_wide(model, opt, seed=step)
                saved = {"digest": model_digest(model.state_dict()), "moments": optimizer_moments(opt)}
                store.save(
                    step,
                    app_state(model, opt),
                    {"rank": rank, "step": step},
                    copy_in_background=("model", "optim"),
                    model_digest=DigestOfEntry("model"),
                )
                store.wait_copied()
                train_step_wide(model, opt, seed=10 + step)  # changes the tensors being saved
                info = store.wait()
                assert info is not None and info.model_digest == saved["digest"]
        restored = {}
        for memory in (tier, None):  # a restart in place, then a new pod
            torch.manual_seed(5)
            fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            train_step_wide(fresh, fresh_opt, seed=99)  # the moments exist to load into
            state = app_state(fresh, fresh_opt)
            with CheckpointStore(uri, memory_tier=memory, persist_behind=True) as store:
                extra = store.load(store.latest_valid(), state)
                set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                restored[store.metrics.last_restore_source] = [
                    extra,
                    model_digest(fresh.state_dict()) == saved["digest"],
                    all(torch.equal(a, b) for a, b in zip(optimizer_moments(fresh_opt), saved["moments"])),
                ]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(restored))
    finally:
        dist.destroy_process_group()


def train_step_wide(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 64, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def optimizer_moments(opt) -> list:
    return [value.clone() for state in opt.state.values() for value in state.values() if value.dim() > 0]


@pytest.mark.slow
def test_each_rank_stages_into_node_memory_only_what_its_last_plan_writes(tmp_path):
    """DCP's plan writes each replicated tensor from one rank; once a plan is known, a rank stages only its part into
    its data file (the first save, planned by DCP, staged everything on both ranks). Both ranks restore the state of
    save time from either tier, though training changed the tensors the moment each copy was made."""
    uri = on_two_ranks(_staging_worker, tmp_path)
    for rank in range(2):
        restored = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert restored == {source: [{"rank": rank, "step": 3}, True, True] for source in ("memory", "storage")}
    steps = {info.step: info for info in CheckpointStore(uri).list(verify=True)}
    assert all(info.valid for info in steps.values())
    data = {
        step: [size for name, size in info.files.items() if name.endswith(".distcp")] for step, info in steps.items()
    }
    assert len(data[1]) == len(data[3]) == 2
    state_bytes = 3 * sum(
        p.numel() * 4 for p in torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).parameters()
    )
    assert all(size > state_bytes for size in data[1])  # each rank's whole state: half of it never read
    assert state_bytes < sum(data[3]) < 1.1 * state_bytes  # one copy of the state between them
    assert max(data[3]) < 0.75 * state_bytes  # both ranks write a part


def test_a_plain_value_is_serialized_again_only_when_its_type_or_value_changes(tmp_path, monkeypatch):
    serialized = []
    original = torch.save

    def counting(obj, *args, **kwargs):
        serialized.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)

    def state(lr, count):
        return {"model": {"w": torch.ones(3)}, "hp": {"lr": lr, "betas": (0.9, 0.95), "count": count}}

    with CheckpointStore(f"file://{tmp_path}/a") as store:
        store.save(1, state(0.1, 1), blocking=True)
        assert all(value in serialized for value in (0.1, (0.9, 0.95), 1))
        serialized.clear()
        store.save(2, state(0.1, 1), blocking=True)
        assert [value for value in serialized if not isinstance(value, (dict, bytes))] == []  # this rank's extra
        store.save(3, state(0.2, 1.0), blocking=True)  # a new lr, and a count of another type
        assert sorted(repr(value) for value in serialized if not isinstance(value, (dict, bytes))) == ["0.2", "1.0"]
        target = state(0.0, 0)
        store.load(next(i for i in store.list() if i.step == 2), target)
        assert target["hp"] == {"lr": 0.1, "betas": (0.9, 0.95), "count": 1}
        store.load(next(i for i in store.list() if i.step == 3), target)
        assert target["hp"]["lr"] == 0.2 and type(target["hp"]["count"]) is float


@pytest.mark.parametrize(
    "a, b, same",
    [
        (1, 1, True),
        (1, 1.0, False),
        (1, True, False),
        ((0.9, 0.95), (0.9, 0.95), True),
        ((0.9, 0.95), [0.9, 0.95], False),
        ([1, [2, 3]], [1, [2, 3.0]], False),
        (float("nan"), float("nan"), False),
        (None, None, True),
    ],
)
def test_values_are_the_same_only_in_type_and_value_all_the_way_down(a, b, same):
    from trainingrun_trainer.checkpoint.save_planner import _same

    assert _same(a, b) is same
