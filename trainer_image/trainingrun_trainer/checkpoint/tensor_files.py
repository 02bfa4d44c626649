"""A rank's DCP data file in format 3: each tensor's bytes as they lie in memory, not a torch.save archive per tensor.

DCP's own writer wraps every tensor in a torch.save zip archive: a serialising copy of every byte and, for a model's
hundred-odd small tensors, most of a small save's cost. Here a tensor is written as its bytes (C order, this
machine's byte order: little-endian on every platform torch trains on); its dtype and shape are DCP's metadata's
already. Each item's storage info names `RAW_TENSOR` as its transform, so DCP's stock reader refuses such a file by
that name ("Unknown extension") instead of misreading it; `read_data` reads both kinds (formats 1 and 2 hold torch.save
items). Reading puts a whole stored chunk straight into the destination tensor when it can (no intermediate copy).

One file per rank (``__<rank>_0.distcp``, as DCP names it), byte items first, then tensors, largest first; a sharded
state on several pods also has rank 0's replicated items in a small file of their own (`REPLICATED_SUFFIX`), which
every pod keeps (`mirroring`).
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..torch_internals import StorageInfo, narrow_tensor_by_index
from .layout import REPLICATED_SUFFIX

#: The transform descriptor of a raw tensor item in DCP's metadata (name/version, as DCP's extensions write them).
RAW_TENSOR = "trainingrun-raw-tensor/1"


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # a buffer


def write_rank_file(
    create_stream: Callable,
    concat_path: Callable,
    root: Any,
    plan: SavePlan,
    resolve: Callable[[Any], Any],
    sync: bool,
    apart: Optional[Callable[[WriteItem], bool]] = None,
) -> list[WriteResult]:
    """Write this rank's items of `plan` into one file below `root`, but those `apart` picks, which go into a second
    file (``__<rank>_replicated.distcp``, written only when it picks any); DCP's write results for them."""
    prefix = plan.storage_data.prefix
    kept: list[WriteItem] = []
    kept_apart: list[WriteItem] = []
    for item in plan.items:
        (kept_apart if apart is not None and apart(item) else kept).append(item)
    results = _write_items(create_stream, concat_path, root, f"{prefix}0{DEFAULT_SUFFIX}", kept, resolve, sync)
    if kept_apart:
        results += _write_items(
            create_stream, concat_path, root, f"{prefix[:-1]}{REPLICATED_SUFFIX}", kept_apart, resolve, sync
        )
    return results


def _write_items(
    create_stream: Callable,
    concat_path: Callable,
    root: Any,
    name: str,
    items: list[WriteItem],
    resolve: Callable[[Any], Any],
    sync: bool,
) -> list[WriteResult]:
    """Write `items` into the file `name` below `root`: byte items first, then tensors, largest first."""
    byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=_largest_first)
    results = []
    with create_stream(concat_path(root, name), "wb") as stream:
        for item in byte_items + tensor_items:
            data = resolve(item)
            offset = stream.tell()
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
                info = StorageInfo(name, offset, stream.tell() - offset)
            else:
                if data.device.type != "cpu":
                    raise ValueError(f"{item.index.fqn}: a staged tensor must be on the CPU, not {data.device}")
                stream.write(byte_view(data.contiguous()))
                info = StorageInfo(name, offset, stream.tell() - offset, transform_descriptors=[RAW_TENSOR])
            results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
        if sync:
            stream.flush()
            os.fsync(stream.fileno())
    return results


def _largest_first(item: WriteItem) -> int:
    """Sort key of a tensor item (it has tensor_data): larger first."""
    assert item.tensor_data is not None
    return -item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _stored_chunk(metadata: TensorStorageMetadata, index: MetadataIndex) -> Any:
    chunks = metadata.chunks
    if (
        index.index is not None
        and index.index < len(chunks)
        and list(chunks[index.index].offsets) == list(index.offset or ())
    ):
        return chunks[index.index]
    return next(chunk for chunk in chunks if list(chunk.offsets) == list(index.offset or ()))


def _read_into(stream: Any, target: memoryview, what: str) -> None:
    done = 0
    while done < target.nbytes:
        read = stream.readinto(target[done:])
        if not read:
            raise OSError(f"{what}: the file ends {target.nbytes - done} bytes early")
        done += read


#: Threads that read one local file at once (the memory tier, file:// storage), each a contiguous part, and the fewest
#: bytes each takes: copying from node memory or the page cache is bound by one core's memory bandwidth, not the
#: memory's. (Streams from object storage are not split: two gcsfs streams of a file through the GCS emulator restored
#: the 258 MB benchmark state 8% slower than one.)
READ_THREADS = min(4, os.cpu_count() or 1)
MIN_BYTES_PER_THREAD = 16 << 20


def read_raw_items(reader: Any, plan: LoadPlan, planner: Any, state_dict_metadata: dict) -> LoadPlan:
    """Load the raw tensor items of `plan` (`reader`: DCP's FsspecReader); the plan of the items left (torch.save
    items of older formats and byte items), for DCP's own read_data. A large file that the reader's FileSystem reads
    locally (`reads_locally`) is read by several threads, each a contiguous part of it through a stream of its own."""
    raw: dict[str, list] = {}
    left = []
    for item in plan.items:
        info: StorageInfo = reader.storage_data[item.storage_index]
        if item.type == LoadItemType.TENSOR and RAW_TENSOR in (info.transform_descriptors or ()):
            raw.setdefault(info.relative_path, []).append((info, item, planner.resolve_tensor(item).detach()))
        else:
            left.append(item)
    for relative_path, items in raw.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        items.sort(key=lambda entry: entry[0].offset)  # one pass through the file
        parts = 1
        if getattr(reader.fs, "reads_locally", lambda _: False)(path):
            parts = max(1, min(READ_THREADS, sum(info.length for info, _, _ in items) // MIN_BYTES_PER_THREAD))
        groups = _contiguous_parts(items, parts)
        if len(groups) == 1:
            _read_items(reader.fs, path, relative_path, groups[0], state_dict_metadata)
        else:
            with ThreadPoolExecutor(len(groups), thread_name_prefix="checkpoint-read") as pool:
                for done in [
                    pool.submit(_read_items, reader.fs, path, relative_path, group, state_dict_metadata)
                    for group in groups
                ]:
                    done.result()
        for _, item, target in items:
            planner.commit_tensor(item, target)
    return dataclasses.replace(plan, items=left)


def _contiguous_parts(items: list, parts: int) -> list[list]:
    """`items` (in file order) cut into at most `parts` runs of about equal bytes."""
    total = sum(info.length for info, _, _ in items)
    groups: list[list] = [[]]
    taken = 0
    for entry in items:
        if groups[-1] and taken >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(entry)
        taken += entry[0].length
    return groups


def _read_items(fs: Any, path: Any, relative_path: str, items: list, state_dict_metadata: dict) -> None:
    """Read `items` ([(storage info, read item, destination tensor)], in file order) from one stream of the file."""
    with fs.create_stream(path, "rb") as stream:
        for info, item, target in items:
            stored = state_dict_metadata[item.storage_index.fqn]
            chunk = _stored_chunk(stored, item.storage_index)
            dtype = stored.properties.dtype
            what = f"{relative_path} ({item.storage_index.fqn})"
            if info.length != chunk.sizes.numel() * dtype.itemsize:
                raise ValueError(f"{what}: {info.length} bytes stored for a {dtype} chunk of {list(chunk.sizes)}")
            stream.seek(info.offset)
            whole = list(item.storage_offsets) == [0] * len(chunk.sizes) and list(item.lengths) == list(chunk.sizes)
            if (
                whole
                and target.device.type == "cpu"
                and target.dtype == dtype
                and target.is_contiguous()
                and target.size() == chunk.sizes
            ):
                _read_into(stream, byte_view(target), what)
            else:
                buffer = bytearray(info.length)
                _read_into(stream, memoryview(buffer), what)
                tensor = torch.frombuffer(buffer, dtype=dtype) if info.length else torch.empty(0, dtype=dtype)
                tensor = narrow_tensor_by_index(tensor.reshape(chunk.sizes), item.storage_offsets, item.lengths)
                if target.size() != tensor.size():
                    raise ValueError(f"{what}: stored {list(tensor.size())}, expected {list(target.size())}")
                target.copy_(tensor)
