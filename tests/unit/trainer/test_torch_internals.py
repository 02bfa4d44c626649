"""Every private torch name the trainer uses is reached here: a torch release that moves one fails this test."""

import importlib

import torch

from trainingrun_trainer import torch_internals


def test_every_eager_private_name_is_what_the_trainer_expects():
    assert all(getattr(torch_internals, name) is not None for name in torch_internals.__all__)
    for cls in (
        torch_internals.FsspecReader,
        torch_internals.FsspecWriter,
        torch_internals.StateDictStager,
        torch_internals.EmptyStateDictLoadPlanner,
    ):
        assert isinstance(cls, type)
    info = torch_internals.StorageInfo("__0_0.distcp", 0, 16)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 0, 16)
    assert torch_internals.narrow_tensor_by_index(torch.arange(10), [2], [3]).tolist() == [2, 3, 4]
    state = {"a": {"b": 0}}
    torch_internals.set_element(state, ("a", "b"), 7)
    assert state == {"a": {"b": 7}}
    shadow = [torch.zeros(2)]
    torch_internals.foreach_lerp_(shadow, [torch.ones(2)], 0.25)
    assert shadow[0].tolist() == [0.25, 0.25]


def test_dcps_save_plan_cache_is_where_the_store_keys_and_clears_it():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    assert all(isinstance(getattr(SavePlanner, name), dict) for name in torch_internals.SAVE_PLAN_CACHES)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    torch_internals.set_plan_cache_key(planner, "test-store")
    planner.set_up_planner({"w": torch.zeros(2)}, is_coordinator=True)
    planner.create_local_plan()
    planner.finish_plan(SavePlan([]))  # promotes the local plan into the cache, under the key
    assert "test-store" in SavePlanner._cached_save_plan
    torch_internals.forget_save_plans("test-store")
    assert not any("test-store" in getattr(SavePlanner, name) for name in torch_internals.SAVE_PLAN_CACHES)


def test_every_lazy_private_name_is_there():
    assert torch_internals.dynamo_config().suppress_errors in (True, False)
    wrapped = torch_internals.checkpoint_wrapper(torch.nn.Linear(2, 2))
    assert wrapped(torch.ones(1, 2)).shape == (1, 2)
    # preload_compile's names (calling it takes seconds: tests/unit/trainer/test_launch.py does)
    assert callable(importlib.import_module("torch._inductor.codecache").torch_key)
    assert callable(importlib.import_module("torch._inductor.cpu_vec_isa").valid_vec_isa_list)
    importlib.import_module("torch._inductor.compile_fx")
    assert callable(importlib.import_module("torch._C._distributed_c10d")._dump_fr_trace_json)  # flight_recorder_json
