"""`RankGroup`: the ranks that checkpoint together, and the few collectives a store runs among them.

A store's collectives run on a gloo group of their own, on its checkpoint thread as well as the training thread, so
they never queue behind (or ahead of) the training step's collectives on the default group. Without torch.distributed
every collective is the identity on one rank."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class RankGroup:
    """This process's rank among the ranks of ``process_group`` (default: all), on a gloo group created for the store.
    Construct it on every rank at the same point of the program (creating a group is itself a collective)."""

    def __init__(self, process_group: Any = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        #: The store's own gloo group (None without torch.distributed).
        self.group: Any = None
        self.rank, self.world_size = 0, 1
        if self.distributed:
            if process_group is None:
                self.group = dist.new_group(backend="gloo")
            else:
                ranks = dist.get_process_group_ranks(process_group)
                self.group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all(self, *flags: bool) -> list[bool]:
        """Each of `flags` and-ed over the ranks (one all_reduce of a small tensor, no pickling)."""
        if not self.distributed:
            return list(flags)
        agreed = torch.tensor([int(flag) for flag in flags], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(flag) for flag in agreed.tolist()]

    def gather_to_first(self, obj: Any) -> list:
        """Every rank's `obj` on rank 0 (in rank order); [] on the other ranks."""
        if not self.distributed:
            return [obj]
        out: Optional[list] = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out or []

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]
