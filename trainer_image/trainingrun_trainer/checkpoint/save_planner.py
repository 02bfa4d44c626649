"""DCP's save planner, planning once while a store's state keeps its layout.

Each DCP save plans: every rank builds a write item per tensor (its shape, dtype, whether it is pinned...), sends its
plan to the coordinator, which merges them into the checkpoint's metadata and sends each rank its final plan. For a
small model saved every few steps that was half of a save's CPU on the checkpoint thread (2-core VM, 0.44 M
parameters + AdamW, 2 ranks: rank 0's thread took 35 ms a save, 18 ms planning once), all of it repeating the last
save's work.

DCP's own plan caching (`enable_plan_caching`) sends an empty plan when the rank's plan equals the last one, and the
coordinator then reuses its merged plan and metadata. It still builds every write item to compare; this planner
skips that too when the state's layout (each entry's name, kind, shape, dtype and layout) is the one the last finished
plan was made from. A write item also records requires_grad and pinning, which the layout leaves out: staged copies
never require grad, and whether the memory tier could pin its pages does not change a plan, so the live state's
layout (before staging) is the staged one's, and the metadata keeps what the last planned save's staged copy was.
Only plain tensors and byte entries take the shortcut; a state with DTensors or sharded tensors is planned by DCP as
before.

Even planning once, `dcp.save` runs four object collectives a save: every rank's (empty) plan to the coordinator and
each rank's final plan back, then every rank's write results to the coordinator and the whole checkpoint metadata
back to every rank, which each unpickles. When every rank's layout is unchanged (`repeats`, agreed by the store with
one small all_reduce), the store skips `dcp.save`: each rank writes by its last final plan (`write_as_planned`) and the
coordinator writes the metadata (`finish_as_planned`) from the write results it gathers with each rank's manifest
entries anyway. A save to node memory then runs 3 collectives instead of 7 (2-core VM, 0.44 M parameters + AdamW, 2
ranks: 33 ms of CPU a save for both ranks instead of 53, `benchmarks/checkpoint_bookkeeping.py`).

Of those 3, gathering every rank's write results (about 60 small objects a rank, pickled by each rank and unpickled by
the coordinator) and pickling the metadata were most of the coordinator's checkpoint thread (a py-spy profile: 21% and
17%). Yet a save by the last plan usually writes the same results as the one before (the same items at the same
offsets; only a plain value whose bytes changed length moves them). So a rank sends `SameResults` in place of results
equal to those it sent with its last committed save, and the coordinator, which kept them, takes its copy; and it
pickles the metadata only when what it would store differs from the last save's, else writes the same bytes. The
metadata leaves out DCP's `storage_meta` (the checkpoint's path and a random save id, which no load reads), so equal
contents make equal bytes.

Each save also resolves every write item: DCP looks for a shard of each tensor (checks that cost 4 ms a save of the
benchmark model's 60 tensors on the checkpoint thread, holding the interpreter lock the training thread needs), and
torch.saves each plain value (an optimizer's lr, betas, eps... one zip archive each). For a state of plain tensors this
planner takes each tensor as it is, and reuses the bytes of a plain value (numbers, strings, None, and lists and tuples
of them) equal in type and value to the one it saved last under that name.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence, Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..torch_internals import set_plan_cache_key


def layout(state_dict: dict[str, Any]) -> Optional[tuple[Hashable, ...]]:
    """What a save plan of this flattened state depends on; None when it holds anything but plain tensors and values
    DCP writes as bytes."""
    parts: list[Hashable] = []
    for name, value in state_dict.items():
        if type(value) in (torch.Tensor, torch.nn.Parameter):  # other subclasses (DTensor...) plan themselves
            parts.append((name, value.dtype, value.layout, tuple(value.shape)))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            parts.append((name, None))
    return tuple(parts)


_SCALARS = (int, float, bool, str, type(None))


def _plain_value(value: Any, depth: int = 0) -> bool:
    """Whether `value` is a number, string or None, or a short list or tuple of such values (at most 2 levels)."""
    if type(value) in _SCALARS:
        return True
    return (
        type(value) in (list, tuple)
        and depth < 2
        and len(value) <= 1024
        and all(_plain_value(v, depth + 1) for v in value)
    )


def _same(a: Any, b: Any) -> bool:
    """Equal in type and value, all the way down (1, 1.0 and True differ; NaN differs from itself)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass(frozen=True)
class SameResults:
    """Sent to the coordinator in place of a rank's write results equal to those it sent with the save of `step`, the
    last it committed by its last plan."""

    step: int


class ReusingSavePlanner(DefaultSavePlanner):
    """A DefaultSavePlanner with DCP's plan caching under `key` (one per store), that also skips building its local
    plan while the state's `layout` is the one of the last finished plan. `finished` carries that layout from one
    save's planner to the next (a planner serves one save), with the last final plan of this rank ("plan"), on the
    coordinator the checkpoint metadata it was merged into ("metadata"), and the bytes of each plain value written
    ("bytes": {name: (value, bytes)}), and of the last save committed by the last plan, the write results this rank
    sent ("sent": (step, results)), on the coordinator those of every rank ("gathered": {rank: (step, results)}) and
    the metadata's pickled bytes ("metadata bytes": (storage data, bytes)). `replicated_to_rank0`: every item that
    several ranks hold alike is written by rank 0 (DCP spreads them over the ranks by size otherwise)."""

    def __init__(self, key: str, finished: dict[str, Any], replicated_to_rank0: bool = False):
        super().__init__(enable_plan_caching=True, dedup_save_to_lowest_rank=replicated_to_rank0)
        set_plan_cache_key(self, key)
        self._finished = finished
        self._layout: Optional[tuple[Hashable, ...]] = None

    def create_local_plan(self) -> SavePlan:
        self._layout = layout(self.state_dict)
        if self._layout is not None and self._layout == self._finished.get("layout"):
            return SavePlan([], usable=False)  # as DCP's caching answers an unchanged plan
        return super().create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        plans, metadata = super().create_global_plan(all_plans)
        self._finished["metadata"] = metadata
        self._finished.pop("metadata bytes", None)
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = super().finish_plan(new_plan)
        # Only once a save's planning went through, as DCP's own cache.
        self._finished.update(layout=self._layout, plan=finished)
        return finished

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self._layout is not None:  # plain tensors and values only (`layout`): no shard to find
            return self.state_dict[index.fqn]
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type != WriteItemType.BYTE_IO or not _plain_value(object):
            return super().transform_object(write_item, object)
        written = self._finished.setdefault("bytes", {})
        last = written.get(write_item.index.fqn)
        if last is not None and _same(last[0], object):
            return io.BytesIO(last[1])
        data = super().transform_object(write_item, object)
        written[write_item.index.fqn] = (copy.deepcopy(object), data.getvalue())
        return data

    def repeats(self, state_dict: dict[str, Any], is_coordinator: bool) -> bool:
        """Set up for saving `state_dict`; whether this rank may write it by its last final plan (its layout is the one
        that plan was made from). Only when every rank's does may the store skip DCP's planning (`write_as_planned`)."""
        # A state with a sharded tensor has no layout, and this planner then serves no save (the store plans such a
        # save afresh): no need to look for one, through the whole state, twice a save.
        self.flatten_sharded_tensors = False
        self.set_up_planner(state_dict, is_coordinator=is_coordinator)
        self._layout = layout(self.state_dict)
        return (
            self._layout is not None
            and self._layout == self._finished.get("layout")
            and "plan" in self._finished
            and (not is_coordinator or "metadata" in self._finished)
        )

    def planned_tensors(self) -> list[torch.Tensor]:
        """The tensors of the state set up by `repeats` that this rank's last final plan writes (DCP's plan writes each
        replicated tensor from one rank only: the rest of this rank's state need not be staged)."""
        return [
            value
            for value in (self.state_dict.get(item.index.fqn) for item in self._finished["plan"].items)
            if isinstance(value, torch.Tensor)
        ]

    def write_as_planned(self, writer: Any, rank: int) -> list[WriteResult]:
        """Write this rank's part of the state set up by `repeats` with `writer` (a DCP StorageWriter) by the last final
        plan, as `dcp.save` would; this rank's write results."""
        # As dcp.save does: an older torch's writers take no rank.
        if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
            writer.set_up_storage_writer(self.is_coordinator, rank=rank, use_collectives=True)
        else:
            writer.set_up_storage_writer(self.is_coordinator)
        return writer.write_data(self._finished["plan"], self).wait()

    def finish_as_planned(self, writer: Any, results: Sequence[list[WriteResult]]) -> None:
        """The coordinator: write the checkpoint's metadata for every rank's `results`, as `dcp.save` does last (by
        `writer.write_metadata`, a `checkpoint.writer.CheckpointWriter`); pickled again only when it changed."""
        storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
        cached = self._finished.get("metadata bytes")
        if cached is None or cached[0] != storage_data:
            metadata = self._finished["metadata"]
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data, metadata.storage_meta = storage_data, None
            cached = self._finished["metadata bytes"] = (storage_data, pickle.dumps(metadata))
        writer.write_metadata(cached[1])

    def results_to_send(self, results: list[WriteResult]) -> Union[list[WriteResult], SameResults]:
        """What this rank sends the coordinator for its write `results`: `SameResults` when they equal those it sent
        with its last save committed by the last plan."""
        sent = self._finished.get("sent")
        return SameResults(sent[0]) if sent is not None and sent[1] == results else results

    def results_received(self, rank: int, received: Union[list[WriteResult], SameResults]) -> list[WriteResult]:
        """The coordinator: `rank`'s write results from what it sent. Raises LookupError when it sent `SameResults` of
        a save this coordinator holds no results of (a commit that one side saw fail)."""
        if not isinstance(received, SameResults):
            return received
        gathered = self._finished.get("gathered", {}).get(rank)
        if gathered is None or gathered[0] != received.step:
            raise LookupError(f"rank {rank} sent the write results of step {received.step}, which rank 0 does not hold")
        return gathered[1]

    def committed(self, step: int, sent: list[WriteResult], gathered: Optional[list[list[WriteResult]]]) -> None:
        """A save by the last plan committed on every rank: the results this rank sent (`gathered`: every rank's, on
        the coordinator) are those the next save may refer to."""
        self._finished["sent"] = (step, sent)
        if gathered is not None:
            self._finished["gathered"] = {rank: (step, results) for rank, results in enumerate(gathered)}

    def not_committed(self) -> None:
        """A save failed: no rank refers to its results, or to any before it."""
        self._finished.pop("sent", None)
        self._finished.pop("gathered", None)
