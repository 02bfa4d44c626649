"""Reading what storage holds without running code from it (see the package's trust model)."""
from __future__ import annotations

import enum
import io
import pickle
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .tensor_files import read_raw_items


#: numpy's RNG state (in ``extra``) is an array: admitted by torch.load(weights_only=True) with these.
_NUMPY_ARRAY_GLOBALS: list = []
try:
    import numpy as _np

    _NUMPY_ARRAY_GLOBALS = [_np._core.multiarray._reconstruct, _np.ndarray, _np.dtype, _np.dtypes.UInt32DType]
except (ImportError, AttributeError):  # numpy absent or 1.x: no arrays to admit
    pass


def load_plain(raw: bytes) -> Any:
    """torch.load of bytes from storage, admitting only plain values (weights_only) and numpy arrays."""
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes ``.metadata`` with plain pickle; this admits only what that pickle is made of."""

    MODULES = ("torch.distributed.checkpoint.metadata",)
    NAMES = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
             ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self.MODULES or (module, name) in self.NAMES or dtype:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # some Pythons pickle an enum member as getattr(EnumClass, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint "
                                     "never holds: refusing to load it")


def _enum_member(cls: Any, name: str) -> Any:
    """getattr restricted to what DCP metadata uses it for: a member of one of its own enums."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.startswith("torch.distributed.checkpoint.") \
            and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"checkpoint metadata asks for getattr({cls!r}, {name!r}): only members of DCP's "
                                 "own enums are loaded")


class _PlainReader(FsspecReader):
    """DCP's fsspec reader for every format: raw tensor items (format 3, `tensor_files`) are read here, the rest
    (torch.save items of formats 1 and 2, byte items) by DCP."""

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._stored = metadata.state_dict_metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(read_raw_items(self, plan, planner, self._stored), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading non-tensor values (optimizer hyperparameters...) as plain values only.

    Top-level entries named in `optional` that the checkpoint lacks are left out of the load (and listed in
    `missing`) instead of failing it: a rank's own entry, which a checkpoint saved by fewer ranks has not."""

    def __init__(self, optional: Iterable[str] = ()) -> None:
        super().__init__()
        self.optional, self.missing = set(optional), set()

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        # Left out of the plan only (the flattened copy): dcp.load hands back every key it was given.
        entry_of = getattr(self, "mappings", {})
        absent = [fqn for fqn in self.state_dict if fqn not in metadata.state_dict_metadata
                  and entry_of.get(fqn, (fqn,))[0] in self.optional]
        for fqn in absent:
            del self.state_dict[fqn]
        self.missing = {entry_of.get(fqn, (fqn,))[0] for fqn in absent}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = load_plain(value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --------------------------------------------------------------------------------------------
