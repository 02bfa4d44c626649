"""Every private torch name the trainer uses, in this one module, each with the reason it is worth the risk.

torch does not promise to keep these. tests/unit/trainer/test_torch_internals.py reaches every one of them, and
tests/unit/test_import_graph.py fails when any other module of the trainer uses a private torch name, so a torch
release that moves one fails those tests, loudly, instead of a run mid-training. The trainer is tested on torch 2.13
(CPU, the pinned version) and runs on the GPU machines' 2.11 (benchmarks/gpu_suite.py runs the unit tests there).

Imported eagerly, so a missing name fails the process at its start: DCP's classes the checkpoint code builds on.
Behind functions, so a process that does not use them never imports them: dynamo and inductor (seconds of import),
activation checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch

# The part of a stored chunk a load asks for: format 3 reads stored chunks whole and hands out the part.
from torch.distributed._shard._utils import narrow_tensor_by_index

# DCP's fsspec storage layer: the checkpoint store reads and writes through subclasses of these (format 3 files,
# digests while writing, the memory tier). Not exported by torch.distributed.checkpoint. The reader's subclass
# (checkpoint/safe_load.py) also calls its private `_get_metadata_path` (READER_METHODS).
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# DCP's flattening of a nested state dict, by which its write items are named: a node's copy of another pod's data
# file finds each tensor by that name (checkpoint/mirroring.py).
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

# Copies a state dict into reused pinned host buffers: a GPU save's staging (0.040 s for 1.8 GB on an H200, against
# 1.52 s for torch.save).
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

# Sets an item of a nested state dict by its DCP path: restoring the non-tensor items of the safe loader.
from torch.distributed.checkpoint._traverse import set_element

# Where an item lives in a DCP data file (path, offset, length): format 3 reads and writes items by it.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# Loading a DCP checkpoint into an empty state dict (`trainingrun checkpoints export`): what dcp_to_torch_save
# does, without writing the whole state to one file first.
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into

#: Private methods of FsspecReader that the safe loader's subclass calls.
READER_METHODS = ("_get_metadata_path",)

#: torch.serialization's layout lookup, which pickled tensors of older checkpoint formats name: the restricted
#: unpickler (checkpoint/safe_load.py) allows exactly this function object.
serialization_get_layout = torch.serialization._get_layout

#: One fused kernel per EMA update instead of one per parameter (ema.py).
foreach_lerp_ = torch._foreach_lerp_

#: DCP's save plan caching (`DefaultSavePlanner(enable_plan_caching=True)`, public) keeps its plans in these
#: process-wide dicts of SavePlanner, by the planner's `_cached_plans_key` (default: the class name, which every store of
#: a process would share). The store gives each of its planners its own key (`set_plan_cache_key`) and drops its
#: entries when it closes (`forget_save_plans`): planning once instead of every save was most of a small model's
#: checkpoint-thread CPU (checkpoint/save_planner.py).
SAVE_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


def set_plan_cache_key(planner: Any, key: str) -> None:
    planner._cached_plans_key = key


def forget_save_plans(key: str) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in SAVE_PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)  # a torch without one: test_torch_internals says so


__all__ = [
    "EmptyStateDictLoadPlanner",
    "FsspecReader",
    "FsspecWriter",
    "StateDictStager",
    "StorageInfo",
    "checkpoint_wrapper",
    "dynamo_config",
    "flatten_state_dict",
    "flight_recorder_json",
    "foreach_lerp_",
    "forget_save_plans",
    "load_state_dict_into",
    "narrow_tensor_by_index",
    "preload_compile",
    "serialization_get_layout",
    "set_element",
    "set_plan_cache_key",
]


def dynamo_config() -> Any:
    """torch.compile's settings (`suppress_errors`: a default compile that fails runs the model uncompiled)."""
    import torch._dynamo

    return torch._dynamo.config


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """`module` recomputing its activations in the backward pass (spec.trainer.activationCheckpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)


def flight_recorder_json() -> Any:
    """torch's flight recorder in this process as JSON (str or bytes): every process group's newest collective
    enqueued and completed, and its entries in flight (hangs.py names the collective a hang waits in from it). torch
    exports no public reader; its own analyzer reads these dumps. Raises where the recorder is off or absent."""
    from torch._C import _distributed_c10d as c10d

    return c10d._dump_fr_trace_json(True, True)  # type: ignore[attr-defined]


def preload_compile(probe_cpu: bool) -> None:
    """Pay torch.compile's per-process costs now (compile_preload.py): inductor's compiler modules, the key of its
    caches, and, when `probe_cpu`, the probe of the CPU's vector instructions (cached per process)."""
    import torch._inductor.codecache as codecache
    import torch._inductor.compile_fx  # noqa: F401  (the import is the point)

    codecache.torch_key()
    if probe_cpu:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
