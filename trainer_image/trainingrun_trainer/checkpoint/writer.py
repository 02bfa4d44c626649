"""The DCP writer that hashes every file as it is written, for the manifest, and copies it to the memory tier."""

from __future__ import annotations

import os
from typing import Optional

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.futures import Future as TorchFuture

from ..torch_internals import FsspecWriter
from .hashing_fs import HashingFileSystem
from .layout import METADATA_NAME
from .memory_tier import MemoryTier
from .tensor_files import write_rank_file
from .tier_staging import StagedFile


class CheckpointWriter(FsspecWriter):
    """DCP's FsspecWriter writing format 3's data files (`tensor_files`), hashing every file written and, on the
    coordinator, removing a stale directory of the same step while planning (before any rank writes data). With a
    `staged` file (`tier_staging`), this rank's data file is the one its state was staged into, completed in place.
    With `replicated_apart_from` (this rank's own entry), the items of a sharded state that are not shards, but for that
    entry, go into a file of their own (`tensor_files.write_rank_file`)."""

    def __init__(
        self,
        path: str,
        record: dict,
        on_global_plan,
        *,
        sync_files: bool,
        tier: Optional[MemoryTier] = None,
        tier_dir: Optional[str] = None,
        segments: bool = False,
        staged: Optional[StagedFile] = None,
        replicated_apart_from: Optional[str] = None,
        **storage_options,
    ):
        super().__init__(path, sync_files=sync_files, overwrite=True, **storage_options)
        self.fs = HashingFileSystem(self.fs, record, tier, tier_dir, segments)  # type: ignore[assignment]  # wraps it
        self._on_global_plan = on_global_plan
        self._record, self._tier, self._tier_dir = record, tier, tier_dir
        self._staged = staged
        self._apart_from = replicated_apart_from
        #: This rank's write results, once it wrote its data file (where each of its items lies in it).
        self.results: list = []

    def write_data(self, plan, planner) -> TorchFuture:
        done: TorchFuture = TorchFuture()
        if self._staged is not None:
            self.results, self._record[self._staged.name] = self._staged.complete(plan, planner.resolve_data)
            done.set_result(self.results)
            return done
        self.results = write_rank_file(
            self.fs.create_stream,
            self.fs.concat_path,
            self.path,
            plan,
            planner.resolve_data,
            self.sync_files,
            apart=None if self._apart_from is None else self._replicated,
        )
        done.set_result(self.results)
        return done

    def _replicated(self, item: WriteItem) -> bool:
        """Whether `item` is one of a sharded state's that every rank holds alike (not a shard, nor this rank's own
        entry `replicated_apart_from`)."""
        return item.type != WriteItemType.SHARD and item.index.fqn != self._apart_from

    def write_metadata(self, data: bytes) -> None:
        """Write DCP's metadata file from its pickled bytes, as DCP's `finish` does after pickling it (to a temporary
        name, then renamed: a reader never sees half of it)."""
        temporary = self.fs.concat_path(self.path, METADATA_NAME + ".tmp")
        with self.fs.create_stream(temporary, "wb") as stream:
            stream.write(data)
            if self.sync_files:
                os.fsync(stream.fileno())
        final = self.fs.concat_path(self.path, METADATA_NAME)
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(temporary, final)

    def _metadata_exists(self) -> bool:
        # DCP warns about an existing .metadata ("overwriting since overwrite=True ...") before
        # planning; re-saving a step is legitimate here and the coordinator clears the stale
        # directory in prepare_global_plan, before anything is written.
        return False

    def prepare_global_plan(self, plans):
        self._on_global_plan()
        return super().prepare_global_plan(plans)


# --------------------------------------------------------------------------------------------
