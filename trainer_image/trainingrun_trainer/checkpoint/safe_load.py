"""Reading what storage holds without running code from it (see the package's trust model)."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pickle
import re
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from trainingrun_api.model_base import ConfigError

from ..torch_internals import FsspecReader, StorageInfo, serialization_get_layout, set_element
from .layout import METADATA_NAME, is_plain_name
from .tensor_files import RAW_TENSOR, read_raw_items

#: The transforms an item's storage info may name: none (formats 1 and 2) or format 3's raw bytes.
_TRANSFORMS = (RAW_TENSOR,)


#: numpy's RNG state (in ``extra``) is an array: admitted by torch.load(weights_only=True) with these.
_NUMPY_ARRAY_GLOBALS: list = []
try:
    import numpy as _np

    _NUMPY_ARRAY_GLOBALS = [
        _np._core.multiarray._reconstruct,  # type: ignore[attr-defined]  # numpy 2's private module
        _np.ndarray,
        _np.dtype,
        _np.dtypes.UInt32DType,
    ]
except (ImportError, AttributeError):  # numpy absent or 1.x: no arrays to admit
    pass


def load_plain(raw: bytes) -> Any:
    """torch.load of bytes from storage, admitting only plain values (weights_only) and numpy arrays."""
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


#: DCP's metadata classes and enums, and what their pickle refers to: exactly these (module, name) pairs load.
_METADATA_NAMES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}", re.ASCII)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,9}", re.ASCII)
#: The largest `.metadata` read (bytes): a few MB for a model of thousands of tensors sharded over thousands of ranks.
MAX_METADATA_BYTES = 512 << 20
#: The deepest path of an entry in the saved state (`planner_data`): a state dict nests a few levels.
MAX_STATE_DEPTH = 64


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name) for name in _METADATA_NAMES
    }
    allowed.update(
        {
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("torch.serialization", "_get_layout"): serialization_get_layout,
            (filesystem.__name__, "_StorageInfo"): StorageInfo,
            ("collections", "OrderedDict"): collections.OrderedDict,
        }
    )
    allowed.update(
        {
            ("torch", name): value
            for name, value in vars(torch).items()
            if isinstance(value, torch.dtype) and _IDENTIFIER.fullmatch(name)
        }
    )
    return allowed


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """DCP writes ``.metadata`` with plain pickle; this admits only what that pickle is made of: exact (module, name)
    pairs, looked up in a table (nothing is imported, no dotted name walks a module's attributes).

    Python's own unpickler, not the C one: the C one grows its memo to any index a PUT opcode names (one changed byte
    of a real `.metadata` took 20 s and gigabytes before failing), this one keeps a dict. The 5.7 MB metadata of a
    3,000-layer model with AdamW loads in 1.9 s instead of 0.8 s; a pre-scan of the opcodes costs as much."""

    ALLOWED = _allowed_globals()
    #: Some Pythons pickle an enum member as getattr(EnumClass, name): admitted for these classes only.
    ENUMS = tuple(value for value in ALLOWED.values() if isinstance(value, type) and issubclass(value, enum.Enum))

    def find_class(self, module: str, name: str) -> Any:
        if not (
            isinstance(module, str)
            and isinstance(name, str)
            and _MODULE.fullmatch(module)
            and _IDENTIFIER.fullmatch(name)
        ):
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {str(module)[:100]!r}.{str(name)[:100]!r}, "
                "which is not a plain name: refusing to load it"
            )
        found = self.ALLOWED.get((module, name))
        if found is not None:
            return found
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never holds: refusing to load it"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("checkpoint metadata holds a persistent id, which a DCP checkpoint never holds")

    #: The classes whose instances BUILD may fill in, and the attributes it may set: their dataclass fields.
    BUILT = {
        value: frozenset(field.name for field in dataclasses.fields(value))
        for value in ALLOWED.values()
        if isinstance(value, type) and dataclasses.is_dataclass(value)
    }

    def load_build(self) -> None:
        """BUILD only on an instance of an allowed dataclass, and only with its fields: pickle's BUILD on a class
        itself (`MetadataIndex`, state `(None, {"__hash__": None})`) would set attributes of DCP's classes for the
        whole process, so that a refused `.metadata` broke every later load and save."""
        stack: list[Any] = self.stack  # type: ignore[attr-defined]  # pickle._Unpickler's own, untyped
        if len(stack) < 2:
            raise pickle.UnpicklingError("checkpoint metadata builds nothing: not a pickle DCP writes")
        state, built = stack[-1], stack[-2]
        fields = self.BUILT.get(type(built))
        if fields is None:
            raise pickle.UnpicklingError(
                f"checkpoint metadata sets attributes of {str(built)[:100]}, which is not an instance of DCP's "
                "metadata classes: refusing to load it"
            )
        if "__setstate__" not in type(built).__dict__:  # a class with its own __setstate__ checks its state itself
            parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
            for part in parts:
                if part is not None and not (isinstance(part, dict) and all(key in fields for key in part)):
                    raise pickle.UnpicklingError(
                        f"checkpoint metadata sets attributes of a {type(built).__name__} other than its fields: "
                        "refusing to load it"
                    )
        super().load_build()  # type: ignore[misc]  # pickle._Unpickler's, untyped

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]


def _enum_member(cls: Any, name: Any) -> Any:
    """getattr restricted to what DCP metadata uses it for: a member of one of its own enums."""
    if cls in _MetadataUnpickler.ENUMS and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(
        f"checkpoint metadata asks for getattr({str(cls)[:100]}, {str(name)[:100]!r}): only "
        "members of DCP's own enums are loaded"
    )


def read_metadata(stream: Any, files: Optional[Mapping[str, int]]) -> Any:
    """DCP's `.metadata` from `stream`, unpickled by `_MetadataUnpickler` and checked by `check_metadata` against
    `files` ({name: size} of the checkpoint's manifest; None: a directory without one, for tests). A ValueError
    says what is wrong with a hostile or damaged one."""
    raw = stream.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f".metadata is larger than {MAX_METADATA_BYTES >> 20} MiB")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - a hostile pickle raises anything its allowed calls raise
        raise ValueError(
            f".metadata is not DCP metadata this trainer reads: {type(exc).__name__}: {str(exc)[:300]}"
        ) from None
    check_metadata(metadata, files)
    return metadata


def check_metadata(metadata: Any, files: Optional[Mapping[str, int]]) -> None:
    """Raise ValueError unless `metadata` is DCP metadata whose every stored item lies inside a file of `files` (a
    plain name, within its size), whose tensors have a dtype and non-negative shapes, and whose entry paths are
    short: what a load reads and allocates is then bounded by what the manifest lists."""
    try:
        _check_metadata(metadata, files)
    except (AttributeError, TypeError) as exc:  # an object unpickled without its fields, an unhashable key...
        raise ValueError(
            f".metadata: malformed ({type(exc).__name__}: {str(exc)[:200]}): not DCP metadata this trainer reads"
        ) from None


def _check_metadata(metadata: Any, files: Optional[Mapping[str, int]]) -> None:
    from torch.distributed.checkpoint import metadata as dcp

    def wrong(what: str) -> ValueError:
        return ValueError(f".metadata: {what}: not DCP metadata this trainer reads")

    def sizes(value: Any) -> bool:
        return (
            isinstance(value, (torch.Size, tuple, list))
            and len(value) <= MAX_STATE_DEPTH
            and all(type(v) is int and v >= 0 for v in value)
        )

    if type(metadata) is not dcp.Metadata:
        raise wrong(f"a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise wrong("state_dict_metadata is not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise wrong("an entry's name is not a string")
        if type(entry) is dcp.TensorStorageMetadata:
            if not (
                type(entry.properties) is dcp.TensorProperties
                and isinstance(entry.properties.dtype, torch.dtype)
                and sizes(entry.size)
                and isinstance(entry.chunks, list)
                and all(
                    type(c) is dcp.ChunkStorageMetadata
                    and sizes(c.offsets)
                    and sizes(c.sizes)
                    and len(c.sizes) == len(c.offsets) == len(entry.size)
                    for c in entry.chunks
                )
            ):
                raise wrong(f"the tensor {fqn[:100]!r} has no dtype or a malformed shape")
        elif type(entry) is not dcp.BytesStorageMetadata:
            raise wrong(f"the entry {fqn[:100]!r} is a {type(entry).__name__}")
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not dcp.StorageMeta:
        raise wrong("storage_meta is not DCP's StorageMeta")
    stored = metadata.storage_data
    if not isinstance(stored, dict):
        raise wrong("storage_data is not a dict")
    for index, info in stored.items():
        if type(index) is not dcp.MetadataIndex or not isinstance(index.fqn, str) or index.fqn not in entries:
            raise wrong("an item's index names no entry")
        if type(info) is not StorageInfo or not is_plain_name(info.relative_path):
            raise wrong(
                f"an item of {index.fqn[:100]!r} is stored in {str(getattr(info, 'relative_path', info))[:100]!r}, "
                "which is not a plain file name"
            )
        if files is not None and info.relative_path not in files:
            raise wrong(
                f"an item of {index.fqn[:100]!r} is stored in {info.relative_path!r}, which the manifest does not list"
            )
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise wrong(f"an item of {index.fqn[:100]!r} has no valid offset and length")
        if files is not None and info.offset + info.length > files[info.relative_path]:
            raise wrong(f"an item of {index.fqn[:100]!r} lies past the end of {info.relative_path}")
        transforms = info.transform_descriptors
        if transforms is not None and not (
            isinstance(transforms, (list, tuple)) and all(t in _TRANSFORMS for t in transforms)
        ):
            raise wrong(f"an item of {index.fqn[:100]!r} names transforms {str(transforms)[:100]}")
    paths = metadata.planner_data
    if paths is not None:
        if not isinstance(paths, dict):
            raise wrong("planner_data is not a dict")
        for fqn, path in paths.items():
            # A path's integers index lists that a load grows to that length: keep them to the entries' count.
            if not (
                isinstance(fqn, str)
                and isinstance(path, (tuple, list))
                and 0 < len(path) <= MAX_STATE_DEPTH
                and all(isinstance(key, str) or (type(key) is int and 0 <= key <= len(entries)) for key in path)
            ):
                raise wrong(f"the path of {str(fqn)[:100]!r} is not a short list of names and indexes")


class PlainReader(FsspecReader):
    """DCP's fsspec reader for every format: raw tensor items (format 3, `tensor_files`) are read here, the rest
    (torch.save items of formats 1 and 2, byte items) by DCP.

    `files`: {name: size} of what the checkpoint's verified manifest lists; the metadata may point at those only."""

    def __init__(self, path: str, files: Optional[Mapping[str, int]], **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        if files is not None and METADATA_NAME not in files:
            raise ValueError(f"{path}: its manifest does not list .metadata")
        self.files = files

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._stored = metadata.state_dict_metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(read_raw_items(self, plan, planner, self._stored), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:  # DCP's fallback when the global metadata failed: never written here
            raise ValueError("this trainer writes no rank-local metadata (__<rank>.metadata) and reads none")
        with self.fs.create_stream(self._get_metadata_path(), "rb") as stream:
            metadata = read_metadata(stream, self.files)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class StateMismatch(ConfigError):
    """The state a load was given and the checkpoint's entries do not match: one line that says how. A configuration
    error (the same on every try), never retried."""


#: An optimizer state entry keyed by parameter index (`optimizer.state_dict()`): `optim.state.0.exp_avg`.
_BY_INDEX = re.compile(r"(^|\.)state\.\d+\.[^.]+$")
#: One keyed by parameter name (torch.distributed.checkpoint.state_dict's get_state_dict): `optim.state.0.weight.step`
#: (an nn.Sequential's first layer), `optim.state.fc.weight.exp_avg`.
_BY_NAME = re.compile(r"(^|\.)state\.(?!\d+\.[^.]+$)[^.]+\..+$")


def listed(names: list[str], most: int = 3) -> str:
    """`(a, b, c, ...)`: the first `most` of some entries."""
    return f"({', '.join(names[:most])}{', ...' if len(names) > most else ''})"


def _forms_hint(lacking: list[str], saved: list[str]) -> str:
    """Why entries may be lacking: the optimizer's state saved keyed one way and asked for keyed the other."""
    for asked, held, how in ((_BY_INDEX, _BY_NAME, "index"), (_BY_NAME, _BY_INDEX, "name")):
        if any(asked.search(fqn) for fqn in lacking) and any(held.search(fqn) for fqn in saved):
            other = "name" if how == "index" else "index"
            return (
                f": the optimizer state was saved keyed by parameter {other} and is read keyed by parameter {how} "
                "(optimizer.state_dict() keys by index, get_state_dict by name): pass the model and optimizer "
                "themselves to Run.save and Run.resume, which convert, or read in the form it was saved in"
            )
    return ": the state passed is not the one that was saved (another model, or entries renamed)"


class PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading non-tensor values (optimizer hyperparameters...) as plain values only.

    Top-level entries named in `optional` that the checkpoint lacks are left out of the load (and listed in
    `missing`) instead of failing it: a rank's own entry, which a checkpoint saved by fewer ranks has not."""

    def __init__(self, optional: Iterable[str] = (), ignored: Callable[[str], bool] = lambda fqn: False) -> None:
        super().__init__()
        self.optional, self.missing = set(optional), set[str]()
        #: The checkpoint's entries the state did not ask for (but those `ignored`: other ranks' own), sorted.
        self.unread: list[str] = []
        self._ignored = ignored

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        # Left out of the plan only (the flattened copy): dcp.load hands back every key it was given.
        entry_of = getattr(self, "mappings", {})
        saved = metadata.state_dict_metadata
        absent = [fqn for fqn in self.state_dict if fqn not in saved and entry_of.get(fqn, (fqn,))[0] in self.optional]
        for fqn in absent:
            del self.state_dict[fqn]
        self.missing = {entry_of.get(fqn, (fqn,))[0] for fqn in absent}
        lacking = sorted(fqn for fqn in self.state_dict if fqn not in saved)
        if lacking:  # DCP would fail on the first with "Missing key in checkpoint state_dict"
            raise StateMismatch(
                f"the checkpoint lacks {len(lacking)} entries the state asks for {listed(lacking)}{_forms_hint(lacking, list(saved))}"
            )
        self.unread = sorted(fqn for fqn in saved if fqn not in self.state_dict and not self._ignored(fqn))

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = load_plain(value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --------------------------------------------------------------------------------------------
