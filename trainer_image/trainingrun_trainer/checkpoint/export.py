"""One checkpoint as a single plain torch.save file, for inference or tools outside this package.

DCP's own `dcp_to_torch_save` cannot read format 3 (tensors stored as their bytes, `tensor_files`): it stops at
"Unknown extension name='trainingrun-raw-tensor'". This reads every format, verifies the checkpoint against its
manifest first and, as every load here, runs no code from storage.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch

from ..torch_internals import EmptyStateDictLoadPlanner, load_state_dict_into
from .errors import SAVE_ERRORS, CheckpointLoadError, describe_error
from .manifest import verify
from .safe_load import PlainLoadPlanner, PlainReader
from .storage import fsspec_options


class _PlainEmptyPlanner(EmptyStateDictLoadPlanner):
    """DCP's planner that builds the state from the checkpoint's metadata, loading non-tensor values as plain values."""

    load_bytes = PlainLoadPlanner.load_bytes


def load_everything(
    uri: str, *, endpoint_url: Optional[str] = None, storage_options: Optional[Mapping] = None
) -> dict[str, Any]:
    """Every entry of the checkpoint directory `uri` (``<base>/step-NNNNNNNN``), nested as it was saved, on the CPU;
    each rank's ``extra-rank-<r>`` entry stays the bytes of its torch.save (`load_plain` reads them; format 1 kept
    them in files of their own, left out here). Raises CheckpointLoadError when the directory is not a valid
    checkpoint."""
    uri = uri.rstrip("/")
    info = verify(uri, endpoint_url=endpoint_url, storage_options=storage_options)
    if not info.valid:
        raise CheckpointLoadError(f"{uri} is not a valid checkpoint: {info.reason}")
    state: dict[str, Any] = {}
    reader = PlainReader(uri, info.files, **fsspec_options(uri, endpoint_url, storage_options))
    try:
        load_state_dict_into(state, storage_reader=reader, planner=_PlainEmptyPlanner(), no_dist=True)
    except SAVE_ERRORS as exc:  # DCP's CheckpointException is a BaseException: say what failed, in one line
        raise CheckpointLoadError(f"cannot load {uri}: {describe_error(exc)}") from None
    return state


def to_torch_save(uri: str, path: "str | os.PathLike[str]", **storage: Any) -> None:
    """Write the checkpoint `uri` to the local file `path` with torch.save (see `load_everything`)."""
    torch.save(load_everything(uri, **storage), path)
