"""checkpoint/save_planner.py: a store plans once while its state keeps its layout, and afresh when it changes."""

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from trainingrun_trainer.checkpoint import CheckpointStore
from trainingrun_trainer.checkpoint.save_planner import layout


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
        key = store._plans_key
    assert not any(key in getattr(SavePlanner, name) for name in ("_cached_save_plan", "_cached_metadata"))


def test_two_stores_in_one_process_keep_their_own_plans(tmp_path):
    with CheckpointStore(f"file://{tmp_path}/a") as one, CheckpointStore(f"file://{tmp_path}/b") as two:
        one.save(1, {"model": {"w": torch.ones(3)}}, blocking=True)
        two.save(1, {"model": {"v": torch.ones(4)}}, blocking=True)
        one.save(2, {"model": {"w": torch.full((3,), 2.0)}}, blocking=True)
        assert loaded(one, 2, {"model": {"w": torch.zeros(3)}})["model"]["w"].tolist() == [2.0] * 3
        assert loaded(two, 1, {"model": {"v": torch.zeros(4)}})["model"]["v"].tolist() == [1.0] * 4


def test_the_layout_is_what_a_write_item_records_and_only_plain_tensors_and_values_have_one():
    base = layout({"w": torch.zeros(2, 3), "extra": b"x"})
    assert base == layout({"w": torch.ones(2, 3), "extra": b"longer"})  # values do not matter
    assert base != layout({"w": torch.zeros(3, 2), "extra": b"x"})
    assert base != layout({"w": torch.zeros(2, 3, dtype=torch.float16), "extra": b"x"})
    assert base != layout({"w": torch.zeros(2, 3, requires_grad=True), "extra": b"x"})

    class Subclass(torch.Tensor):  # DTensor and other subclasses plan themselves
        pass

    assert layout({"w": torch.zeros(2).as_subclass(Subclass)}) is None
