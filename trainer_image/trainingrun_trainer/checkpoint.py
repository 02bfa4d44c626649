"""The trainer's checkpoint store: torch.distributed.checkpoint (DCP) on gs://, s3:// or file://.

Layout of one checkpoint, ``<uri>/step-<step, 8 digits>/``::

    .metadata              DCP's global metadata (rank 0)
    __<rank>_<n>.distcp    DCP data files, written by every rank (replicated tensors are
                           de-duplicated by DCP's planner, so a DDP model is written once)
    extra-rank-<r>.pt      torch.save of that rank's ``extra`` dict (RNG states, sampler...)
    manifest.json          the commit marker, written LAST by rank 0

``manifest.json`` = ``{format_version, step, time, world_size, config_hash, model_digest,
torch_version, files: [{path, size, sha256}]}`` listing every other file of the directory.
A checkpoint without a valid manifest does not exist: readers skip directories with no manifest
(a save that never finished) and directories whose files are missing or do not match the
manifest's sizes / sha256 (corruption), and fall back to older ones.

Every scheme goes through fsspec and DCP's ``FsspecWriter`` / ``FsspecReader``, file:// (or a
plain path) included: one code path, so the fast file:// tests exercise the same code that
writes to buckets. ``gs://`` uses gcsfs defaults (Application Default Credentials,
``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``); ``s3://`` uses s3fs defaults
(``AWS_*`` variables) and honours ``endpoint_url`` (config ``checkpoint.endpointUrl``) or
``AWS_ENDPOINT_URL``. ``storage_options`` passes anything else to the fsspec filesystem.

How a save is sequenced (same on every rank; collectives use a dedicated gloo group):

1. ``save()`` (training thread) first finishes the previous save, then stages: DCP's
   ``BlockingAsyncStager`` copies every tensor of ``state`` into new CPU tensors (a real copy,
   also for CPU tensors), and ``extra`` is serialized to bytes. Then it returns; the training
   loop may change its tensors at once.
2. A single background thread (reused across saves, so fsspec/gcsfs sessions are reused) runs
   ``dcp.save``: rank 0 clears a stale directory of the same step while planning (before any
   rank writes), every rank writes its data files, rank 0 writes ``.metadata`` after DCP has
   gathered every rank's write results. Sizes and sha256 are computed while the bytes stream
   out, so nothing is read back.
3. Every rank writes ``extra-rank-<r>.pt``; all ranks exchange (ok/error, file hashes).
4. Only if every rank succeeded, rank 0 writes ``manifest.json`` (file://: temp file, fsync,
   rename; object stores: one PUT, which is atomic) and broadcasts the outcome, so every rank's
   ``wait()`` returns the same :class:`CheckpointInfo` (or ``None``).
5. Rank 0 rotates (:meth:`CheckpointStore.rotate`).

A storage error in steps 2-4 never raises into the training loop: each rank logs it once
(logger ``trainingrun.checkpoint``), counts it in ``failed_saves``, no manifest is written, and
the next save starts from scratch. Errors while staging (a caller bug such as an unpicklable
``extra``) do raise.

Trust model: nothing read from storage can run code. ``extra`` files and DCP's non-tensor values
are loaded with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples, dicts,
numpy arrays), DCP's ``.metadata`` with an unpickler that admits only DCP's metadata classes, torch
dtypes and sizes; anything else fails the load, and resume falls back to an older checkpoint. Keep
``extra`` to such plain values. The sha256 in the manifest detects corruption (every file is
re-hashed before a resume), not tampering by someone who may write the bucket.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import logging
import os
import pickle
import posixpath
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Optional, Union

# gcsfs's experimental zonal/HNS bucket support probes every bucket first; against the GCS
# emulator that probe hangs for about a minute. We need neither; a user may still opt in.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from fsspec.core import url_to_fs  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.staging import BlockingAsyncStager  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from .contract import rfc3339  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "CheckpointLoadError",
    "CheckpointStore",
    "PendingSave",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "format_table",
    "model_digest",
    "step_dir_name",
    "to_json",
    "verify",
]

logger = logging.getLogger("trainingrun.checkpoint")

#: Version of the manifest format; readers accept this version only.
FORMAT_VERSION = 1
#: Name of the commit marker inside a checkpoint directory.
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_EXTRA = "extra-rank-{rank}.pt"
_HASH_CHUNK = 8 * 1024 * 1024
# DCP's CheckpointException derives from BaseException, not Exception: catch it by name.
_SAVE_ERRORS = (Exception, CheckpointException)

# DCP warns on every single-process save/load that torch.distributed is not initialized;
# single-process is a supported mode here, so that one message is silenced.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------------------------
# Reading what storage holds without running code from it


class CheckpointLoadError(Exception):
    """A committed checkpoint that cannot be loaded (its content, not its files, is wrong)."""


class StorageUnavailable(Exception):
    """The checkpoint storage could not be read (unreachable, refused, timed out): a later attempt may succeed."""


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
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, loading non-tensor values (optimizer hyperparameters...) as plain values only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = load_plain(value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --------------------------------------------------------------------------------------------
# Public data types


@dataclass
class CheckpointInfo:
    """One checkpoint directory as found in storage.

    ``valid`` is False when the directory has no manifest or its files do not match it; then
    ``reason`` says why ("no manifest (partial save)", "missing file <f>", "size mismatch in <f>",
    "sha256 mismatch in <f>", "manifest unreadable: ..."). ``time`` is the manifest's commit time
    (RFC 3339, UTC); for a directory without a readable manifest, the newest file's modification
    time when storage reports one, else "". ``size_bytes`` counts every file in the directory.
    ``manifest_sha256`` (sha256 of manifest.json) identifies the committed checkpoint, e.g. in
    the TrainingRun's ``status.lastGoodCheckpoint.sha256``.
    """

    step: int
    uri: str
    time: str
    size_bytes: int
    valid: bool
    reason: Optional[str] = None
    model_digest: Optional[str] = None
    world_size: Optional[int] = None
    manifest_sha256: Optional[str] = None


class PendingSave:
    """Handle of one save returned by :meth:`CheckpointStore.save`.

    ``step``: the step being saved. ``blocking_seconds``: how long ``save()`` blocked its caller.
    ``done()``: whether the save finished (committed or failed). ``result(timeout=None)``: waits
    and returns the committed :class:`CheckpointInfo`, or ``None`` when the save failed; it never
    raises a storage error.
    """

    def __init__(self, step: int, future: "Future[Optional[CheckpointInfo]]", blocking_seconds: float):
        self.step = step
        self.blocking_seconds = blocking_seconds
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional[CheckpointInfo]:
        return self._future.result(timeout)

    def __repr__(self) -> str:
        return f"PendingSave(step={self.step}, done={self.done()})"


# --------------------------------------------------------------------------------------------
# Helpers: time, names, storage


def now_rfc3339() -> str:
    return rfc3339(datetime.now(timezone.utc), fraction=True)


def step_dir_name(step: int) -> str:
    """Directory name of a step's checkpoint: ``step-00000100``."""
    return f"step-{step:08d}"


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _storage_options(uri: str, endpoint_url: Optional[str], storage_options: Optional[Mapping]) -> dict:
    opts = dict(storage_options or {})
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme in ("s3", "s3a"):
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts.setdefault("endpoint_url", endpoint)
    elif scheme in ("gs", "gcs"):
        if endpoint_url:
            opts.setdefault("endpoint_url", endpoint_url)
    elif endpoint_url:
        raise ValueError(f"endpoint_url is only used with s3:// or gs:// URIs, not {uri!r}")
    return opts


def _entry_time(entry: Mapping) -> str:
    """Best-effort modification time of an fsspec ls entry (local, gcsfs, s3fs) as RFC 3339."""
    for key in ("mtime", "updated", "LastModified", "last_modified"):
        value = entry.get(key)
        if value is None:
            continue
        try:
            if isinstance(value, (int, float)):
                dt = datetime.fromtimestamp(value, timezone.utc)
            elif isinstance(value, datetime):
                dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
            else:
                dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        except (TypeError, ValueError, OverflowError, OSError):
            continue
    return ""


class _Storage:
    """The few fsspec operations the store needs, on URIs below one base URI."""

    def __init__(self, uri: str, options: Mapping):
        self.options = dict(options)
        self.fs, _ = url_to_fs(uri, **self.options)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")

    def _path(self, uri: str) -> str:
        return self.fs._strip_protocol(uri)

    def listing(self, uri: str) -> dict[str, dict]:
        """{name: ls entry} of the files and dirs directly below uri ({} when it does not exist).

        Listing caches are dropped first: other ranks and processes write here too.
        """
        path = self._path(uri)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if name and entry["name"].rstrip("/") != path.rstrip("/"):
                out[name] = entry
        return out

    def read_bytes(self, uri: str) -> bytes:
        return self.fs.cat_file(self._path(uri))

    def sha256(self, uri: str) -> tuple[int, str]:
        digest = hashlib.sha256()
        size = 0
        with self.fs.open(self._path(uri), "rb", block_size=_HASH_CHUNK) as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def write_bytes(self, uri: str, data: bytes, atomic: bool = False) -> None:
        """Write a whole file. On file://, fsync it, and with atomic=True write a temp file and
        rename it into place. On object stores, one PUT is already atomic and durable."""
        path = self._path(uri)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        target = path + ".tmp" if atomic else path
        with open(target, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)

    def rm_file(self, uri: str) -> None:
        self.fs.rm_file(self._path(uri))

    def rm_tree(self, uri: str) -> None:
        self.fs.rm(self._path(uri), recursive=True)


def _is_file(entry: Mapping) -> bool:
    return entry.get("type", "file") == "file"


# --------------------------------------------------------------------------------------------
# Hashing DCP writer


class _HashingStream:
    """Passes writes to a DCP output stream and keeps the size and sha256 of what went through."""

    def __init__(self, raw: Any):
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        self._sha.update(view)
        self.size += view.nbytes
        return view.nbytes if written is None else written

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, seekable...
        return getattr(self._raw, name)


class _HashingFileSystem:
    """Wraps DCP's fsspec FileSystem: records {basename: (size, sha256)} of every file DCP writes,
    following DCP's rename of ``.metadata.tmp`` to ``.metadata``."""

    def __init__(self, inner: Any, record: dict):
        self._inner = inner
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        if not any(ch in mode for ch in "wa+"):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self._inner.create_stream(path, mode) as stream:
            tee = _HashingStream(stream)
            yield tee
        self._record[posixpath.basename(os.fspath(path))] = (tee.size, tee.hexdigest())

    def rename(self, path, new_path) -> None:
        self._inner.rename(path, new_path)
        record = self._record.pop(posixpath.basename(os.fspath(path)), None)
        if record is not None:
            self._record[posixpath.basename(os.fspath(new_path))] = record


class _Writer(FsspecWriter):
    """DCP's FsspecWriter plus hashing of every file written and, on the coordinator, the removal
    of a stale directory of the same step while planning (before any rank writes data)."""

    def __init__(self, path: str, record: dict, on_global_plan, *, sync_files: bool, **storage_options):
        super().__init__(path, sync_files=sync_files, overwrite=True, **storage_options)
        self.fs = _HashingFileSystem(self.fs, record)
        self._on_global_plan = on_global_plan

    def _metadata_exists(self) -> bool:
        # DCP warns about an existing .metadata ("overwriting since overwrite=True ...") before
        # planning; re-saving a step is legitimate here and the coordinator clears the stale
        # directory in prepare_global_plan, before anything is written.
        return False

    def prepare_global_plan(self, plans):
        self._on_global_plan()
        return super().prepare_global_plan(plans)


# --------------------------------------------------------------------------------------------
# Inspecting checkpoints


def _parse_manifest(raw: bytes) -> dict:
    manifest = json.loads(raw)
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
        and isinstance(f.get("sha256"), str)
        for f in files
    ):
        raise ValueError("'files' is not a list of {path, size, sha256}")
    if not isinstance(manifest.get("step"), int):
        raise ValueError("'step' is not an integer")
    return manifest


def _inspect(storage: _Storage, uri: str, step: int, deep: bool,
             trusted: Optional[Mapping[str, str]] = None) -> CheckpointInfo:
    """Check one step directory. Shallow: manifest readable, every file present with its size.
    Deep: also re-hash every file, unless ``trusted`` maps this uri to this very manifest's sha256
    (this process wrote or verified it; used by rotation only)."""
    listing = storage.listing(uri)
    files = {name: e for name, e in listing.items() if _is_file(e)}
    size = sum(int(e.get("size") or 0) for e in files.values())
    newest = max((_entry_time(e) for e in files.values()), default="")

    def invalid(reason: str, manifest: Optional[dict] = None, manifest_sha: Optional[str] = None):
        manifest = manifest or {}
        return CheckpointInfo(
            step=step, uri=uri, time=manifest.get("time") or newest, size_bytes=size, valid=False,
            reason=reason, model_digest=manifest.get("model_digest") or None,
            world_size=manifest.get("world_size"), manifest_sha256=manifest_sha,
        )

    if MANIFEST_NAME not in files:
        return invalid("no manifest (partial save)")
    try:
        raw = storage.read_bytes(_join(uri, MANIFEST_NAME))
        manifest_sha = hashlib.sha256(raw).hexdigest()
        manifest = _parse_manifest(raw)
    except FileNotFoundError:
        return invalid("no manifest (partial save)")
    except Exception as exc:  # unreadable JSON, wrong format version, storage error
        return invalid(f"manifest unreadable: {exc}")
    if manifest["step"] != step:
        return invalid(f"manifest is for step {manifest['step']}", manifest, manifest_sha)
    for entry in manifest["files"]:
        name = entry["path"]
        if name not in files:
            return invalid(f"missing file {name}", manifest, manifest_sha)
        listed = files[name].get("size")
        if listed is not None and int(listed) != entry["size"]:
            return invalid(f"size mismatch in {name}", manifest, manifest_sha)
    if deep and not (trusted and trusted.get(uri) == manifest_sha):
        for entry in manifest["files"]:
            name = entry["path"]
            try:
                got_size, got_sha = storage.sha256(_join(uri, name))
            except FileNotFoundError:
                return invalid(f"missing file {name}", manifest, manifest_sha)
            if got_size != entry["size"]:
                return invalid(f"size mismatch in {name}", manifest, manifest_sha)
            if got_sha != entry["sha256"]:
                return invalid(f"sha256 mismatch in {name}", manifest, manifest_sha)
    return CheckpointInfo(
        step=step, uri=uri, time=manifest.get("time") or newest, size_bytes=size, valid=True,
        reason=None, model_digest=manifest.get("model_digest") or None,
        world_size=manifest.get("world_size"), manifest_sha256=manifest_sha,
    )


def _step_dirs(storage: _Storage, base_uri: str) -> list[tuple[int, str]]:
    """(step, uri) of every step-* directory below base_uri, newest step first."""
    found = []
    for name, entry in storage.listing(base_uri).items():
        match = _STEP_DIR.match(name)
        if match and not _is_file(entry):
            found.append((int(match.group(1)), _join(base_uri, name)))
    return sorted(found, reverse=True)


def verify(uri: str, *, endpoint_url: Optional[str] = None,
           storage_options: Optional[Mapping] = None) -> CheckpointInfo:
    """Re-hash the files of one checkpoint directory (``<base>/step-NNNNNNNN``) against its
    manifest and return what was found; ``valid`` False with a ``reason`` when they differ."""
    uri = uri.rstrip("/")
    match = _STEP_DIR.match(posixpath.basename(uri))
    if not match:
        raise ValueError(f"{uri!r} is not a checkpoint directory (expected .../step-NNNNNNNN)")
    storage = _Storage(uri, _storage_options(uri, endpoint_url, storage_options))
    return _inspect(storage, uri, int(match.group(1)), deep=True)


# --------------------------------------------------------------------------------------------
# Model digest


def _canonical_name(name: str) -> str:
    # DDP wraps the model in `module.`, torch.compile in `_orig_mod.`: strip them from the front so
    # the same weights give the same digest however they were wrapped.
    changed = True
    while changed:
        changed = False
        for prefix in ("module.", "_orig_mod."):
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _flatten(tree: Mapping, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def model_digest(state_dict: Mapping[str, Any]) -> str:
    """sha256 over a model's tensors: for each tensor, in sorted order of its canonical name
    (leading ``module.`` / ``_orig_mod.`` removed), its name, dtype, shape and the bytes of the
    contiguous CPU tensor. Non-tensor entries are ignored; nested dicts are flattened with ".".

    Equal weights give equal digests whatever the world size: replicated (DDP) weights are hashed
    as they are, sharded DTensors (FSDP2) are gathered with ``full_tensor()``, which is a
    collective: with sharded weights, call this on every rank.
    """
    items = {}
    for name, value in _flatten(state_dict):
        if isinstance(value, torch.Tensor):
            canonical = _canonical_name(name)
            if canonical in items:
                raise ValueError(f"two tensors map to the name {canonical!r}")
            items[canonical] = value
    digest = hashlib.sha256()
    for name in sorted(items):
        tensor = items[name]
        full_tensor = getattr(tensor, "full_tensor", None)
        if full_tensor is not None:  # DTensor
            tensor = full_tensor()
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# The store


@dataclass
class _SaveJob:
    step: int
    state: Any
    extra: bytes
    config_hash: str
    model_digest: Union[str, Callable[[Mapping[str, Any]], str]]
    started: float
    logged: bool = False  # this rank already logged the failure


def _describe(exc: BaseException) -> str:
    """One line about an error; for DCP's CheckpointException, the underlying error of each rank."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict):
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def _stage(state: Mapping[str, Any]) -> dict:
    """CPU copy of `state` (Stateful objects replaced by their state_dict), as DCP's async_save
    stages it: new CPU tensors filled by copy, containers rebuilt, other values deep-copied."""
    plain = {key: (value.state_dict() if isinstance(value, Stateful) else value) for key, value in state.items()}
    return BlockingAsyncStager(type_check=False).stage(plain)


class CheckpointStore:
    """Saves, lists, loads and rotates checkpoints below ``uri`` (gs://, s3://, file:// or a path).

    Args:
        uri: base URI of the run's checkpoints; each step gets ``<uri>/step-NNNNNNNN/``.
        keep: newest valid checkpoints that rotation keeps (>= 1).
        keep_every: also keep every valid checkpoint whose step is a multiple of this.
        endpoint_url: S3-compatible endpoint for s3:// (default ``AWS_ENDPOINT_URL``); for gs://,
            a GCS endpoint such as an emulator.
        process_group: the ranks that checkpoint together (default: all). Under torch.distributed
            the store creates its own gloo group over these ranks for its background collectives,
            so construct the store on every rank at the same point of the program.
        storage_options: extra keyword arguments for the fsspec filesystem (e.g. ``token``).

    Metrics of this rank, for Prometheus: ``failed_saves``, ``committed_saves``, ``restores``; ``last_blocking_seconds`` (how long
    ``save()`` held the training loop, including waiting for the previous save);
    ``last_save_seconds`` (staging start to commit); ``last_save_bytes`` (bytes this rank wrote,
    manifest included on rank 0); ``last_restore_seconds`` (last ``load()``).

    The store is not thread-safe: call it from the training thread only.
    """

    def __init__(self, uri: str, keep: int = 3, keep_every: Optional[int] = None,
                 endpoint_url: Optional[str] = None, process_group: Any = None, *,
                 storage_options: Optional[Mapping] = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be at least 1 or None, got {keep_every}")
        uri = uri.rstrip("/") if not uri.rstrip("/").endswith(":") else uri
        self.uri = uri
        self.keep = keep
        self.keep_every = keep_every
        self._options = _storage_options(uri, endpoint_url, storage_options)
        self._storage = _Storage(uri, self._options)

        self._distributed = dist.is_available() and dist.is_initialized()
        self._pg = None
        self.rank, self.world_size = 0, 1
        if self._distributed:
            if process_group is None:
                self._pg = dist.new_group(backend="gloo")
            else:
                ranks = dist.get_process_group_ranks(process_group)
                self._pg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self.rank = dist.get_rank(self._pg)
            self.world_size = dist.get_world_size(self._pg)

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainingrun-checkpoint")
        self._pending: Optional[PendingSave] = None
        self._last_result: Optional[CheckpointInfo] = None
        # uri -> manifest sha256 of checkpoints this process committed or deep-verified.
        self._trusted: dict[str, str] = {}
        self._closed = False
        self._manifest_bytes = 0

        self.failed_saves = 0
        self.committed_saves = 0
        self.restores = 0
        self.last_save_seconds = 0.0
        self.last_save_bytes = 0
        self.last_blocking_seconds = 0.0
        self.last_restore_seconds = 0.0

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Mapping[str, Any], extra: Optional[Mapping[str, Any]] = None, *,
             config_hash: str = "", model_digest: Union[str, Callable[[Mapping[str, Any]], str]] = "",
             blocking: bool = False) -> PendingSave:
        """Checkpoint ``state`` as ``<uri>/step-NNNNNNNN``; call on every rank.

        ``state``: a dict for DCP (tensors, DTensors, nested dicts, Stateful objects; use
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` for model + optimizer).
        ``extra``: this rank's own small state (RNG states, sampler position...), torch.save'd to
        ``extra-rank-<r>.pt``. ``config_hash`` and ``model_digest`` (see :func:`model_digest`)
        are recorded in the manifest as given ("" = not recorded); ``model_digest`` may be a
        function of the staged state, then rank 0 computes it in the background.

        Finishes the previous save first, then stages (copies) state and extra and returns; the
        write and commit run in the background unless ``blocking``. Never raises a storage error:
        a failed save returns a handle whose ``result()`` is None and counts in ``failed_saves``.
        """
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        began = time.perf_counter()
        self.wait()
        started = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(dict(extra or {}), buffer)
        job = _SaveJob(step=step, state=_stage(state), extra=buffer.getvalue(),
                       config_hash=config_hash, model_digest=model_digest, started=started)
        if blocking:
            future: Future = Future()
            future.set_result(self._run(job))
        else:
            future = self._executor.submit(self._run, job)
        self.last_blocking_seconds = time.perf_counter() - began
        pending = PendingSave(step, future, self.last_blocking_seconds)
        self._pending = pending
        return pending

    def wait(self) -> Optional[CheckpointInfo]:
        """Finish the save in flight, if any, and return the most recent save's outcome: the
        committed :class:`CheckpointInfo`, or None if it failed (or nothing was saved yet)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last_result = pending.result()
        return self._last_result

    def close(self) -> None:
        """Finish the save in flight and stop the background thread. Idempotent."""
        if self._closed:
            return
        self.wait()
        self._executor.shutdown(wait=True)
        self._closed = True

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step_uri(self, step: int) -> str:
        return _join(self.uri, step_dir_name(step))

    def _clear_step_dir(self, step_uri: str) -> None:
        """Coordinator, while DCP plans: remove what an earlier save of this step left (manifest
        first, so the directory is never a committed checkpoint with new data)."""
        listing = self._storage.listing(step_uri)
        if not listing:
            return
        if MANIFEST_NAME in listing:
            logger.warning("overwriting the committed checkpoint %s", step_uri)
            self._storage.rm_file(_join(step_uri, MANIFEST_NAME))
            self._trusted.pop(step_uri, None)
        for name, entry in listing.items():
            if name == MANIFEST_NAME:
                continue
            if _is_file(entry):
                self._storage.rm_file(_join(step_uri, name))
            else:
                self._storage.rm_tree(_join(step_uri, name))

    def _gather(self, obj: Any) -> list:
        if not self._distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self._pg, group_src=0)
        return box[0]

    def _run(self, job: _SaveJob) -> Optional[CheckpointInfo]:
        """Write, commit, rotate. Runs on every rank (background thread unless blocking); never
        raises: errors become a None result, a log record and failed_saves."""
        step_uri = self._step_uri(job.step)
        record: dict[str, tuple[int, str]] = {}
        error: Optional[str] = None
        try:
            writer = _Writer(
                step_uri, record,
                on_global_plan=lambda: self._clear_step_dir(step_uri),
                sync_files=self._storage.local, **self._options,
            )
            dcp.save(job.state, storage_writer=writer, process_group=self._pg,
                     no_dist=not self._distributed)
            name = _EXTRA.format(rank=self.rank)
            self._storage.write_bytes(_join(step_uri, name), job.extra)
            record[name] = (len(job.extra), hashlib.sha256(job.extra).hexdigest())
        except _SAVE_ERRORS as exc:
            error = _describe(exc)
            logger.error("checkpoint step %d: rank %d could not write %s: %s",
                         job.step, self.rank, step_uri, error, exc_info=True)
            job.logged = True
        if callable(job.model_digest):
            # From the staged copy, in the background, so training does not wait for it; rank 0 only
            # writes the manifest, so only rank 0 computes it.
            job.model_digest = job.model_digest(job.state) if self.rank == 0 and error is None else ""
        job.state = None  # drop the staged copy

        outcome: Optional[tuple[Optional[CheckpointInfo], Optional[str]]] = None
        try:
            statuses = self._gather((error, record))
            if self.rank == 0:
                outcome = self._commit(job, step_uri, statuses)
            outcome = self._broadcast(outcome)
        except _SAVE_ERRORS as exc:  # a collective failed (peer died, timeout)
            outcome = (None, _describe(exc))
            if not job.logged:
                logger.error("checkpoint step %d: rank %d lost contact with its peers: %s",
                             job.step, self.rank, outcome[1], exc_info=True)
                job.logged = True
        info, commit_error = outcome
        if info is None:
            self.failed_saves += 1
            if not job.logged:  # another rank failed: one record on this rank too
                logger.error("checkpoint step %d was not committed: %s", job.step, commit_error)
            return None

        self.last_save_seconds = time.perf_counter() - job.started
        self.last_save_bytes = sum(size for size, _ in record.values())
        self.committed_saves += 1
        if self.rank == 0:
            self.last_save_bytes += self._manifest_bytes
            logger.info("committed checkpoint step %d to %s (%d bytes, %.2f s)", job.step, info.uri,
                        info.size_bytes, self.last_save_seconds)
            try:
                self._rotate()
            except Exception as exc:
                logger.error("checkpoint rotation below %s failed: %s", self.uri, exc, exc_info=True)
        return info

    def _commit(self, job: _SaveJob, step_uri: str, statuses: list) -> tuple[Optional[CheckpointInfo], Optional[str]]:
        """Rank 0: write the manifest if every rank succeeded. Returns (info, error)."""
        self._manifest_bytes = 0
        failed = [(rank, err) for rank, (err, _) in enumerate(statuses) if err is not None]
        if failed:
            return None, "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        files = {}
        for _, record in statuses:
            files.update(record)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "time": now_rfc3339(),
            "world_size": self.world_size,
            "config_hash": job.config_hash,
            "model_digest": job.model_digest,
            "torch_version": torch.__version__,
            "files": [{"path": name, "size": size, "sha256": sha}
                      for name, (size, sha) in sorted(files.items())],
        }
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        try:
            self._storage.write_bytes(_join(step_uri, MANIFEST_NAME), raw, atomic=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("checkpoint step %d: writing the manifest failed: %s", job.step, error, exc_info=True)
            job.logged = True
            return None, f"rank 0: {error}"
        self._manifest_bytes = len(raw)
        manifest_sha = hashlib.sha256(raw).hexdigest()
        self._trusted[step_uri] = manifest_sha
        info = CheckpointInfo(
            step=job.step, uri=step_uri, time=manifest["time"],
            size_bytes=sum(size for size, _ in files.values()) + len(raw), valid=True, reason=None,
            model_digest=job.model_digest or None, world_size=self.world_size,
            manifest_sha256=manifest_sha,
        )
        return info, None

    # ------------------------------------------------------------------ reading

    def list(self, verify: bool = True) -> list[CheckpointInfo]:
        """Every step directory below the store's uri, newest step first, valid or not. With
        ``verify`` (default) every file is re-hashed; without, only presence and sizes are checked.
        Works on any single rank (no collective)."""
        return [_inspect(self._storage, uri, step, deep=verify)
                for step, uri in _step_dirs(self._storage, self.uri)]

    def _find_latest_valid(self) -> Optional[CheckpointInfo]:
        for step, uri in _step_dirs(self._storage, self.uri):
            info = _inspect(self._storage, uri, step, deep=True)  # always re-hash: resume path
            if info.valid:
                self._trusted[uri] = info.manifest_sha256
                return info
            logger.warning("skipping checkpoint %s: %s", uri, info.reason)
        return None

    def latest_valid(self) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose files match its manifest (every file re-hashed, also the
        ones this process wrote), or None; invalid newer directories are skipped with a warning.

        Finishes the save in flight first. Under torch.distributed this is a collective: call it
        on every rank; rank 0 verifies and broadcasts the answer, so every rank resumes from the
        same checkpoint."""
        self.wait()
        if not self._distributed:
            return self._find_latest_valid()
        result: Any = None
        if self.rank == 0:
            try:
                result = self._find_latest_valid()
            except Exception as exc:
                result = exc
        result = self._broadcast(result)
        if isinstance(result, Exception):
            raise result
        if result is not None:
            self._trusted[result.uri] = result.manifest_sha256  # verified by rank 0: no rank re-hashes it
        return result

    def load(self, info_or_uri: Union[CheckpointInfo, str], state: dict) -> dict:
        """Load a checkpoint into ``state`` in place (DCP: tensors are copied into the tensors
        already in ``state``, resharding as needed; Stateful objects get ``load_state_dict``) and
        return this rank's ``extra`` dict ({} with a warning when the checkpoint was written by
        fewer ranks). Under torch.distributed, call on every rank.

        Every file is re-hashed against the manifest first, and a ValueError raised if it is not a
        committed checkpoint, unless this process wrote or verified this very manifest (a
        CheckpointInfo from :meth:`latest_valid` was).
        """
        self.wait()
        began = time.perf_counter()
        uri = info_or_uri.uri if isinstance(info_or_uri, CheckpointInfo) else str(info_or_uri).rstrip("/")
        match = _STEP_DIR.match(posixpath.basename(uri))
        if not match:
            raise ValueError(f"{uri!r} is not a checkpoint directory (expected .../step-NNNNNNNN)")
        info = _inspect(self._storage, uri, int(match.group(1)), deep=True, trusted=self._trusted)
        if not info.valid:
            raise ValueError(f"{uri} is not a valid checkpoint: {info.reason}")
        reader = _PlainReader(uri, **self._options)
        try:
            dcp.load(state, storage_reader=reader, planner=_PlainLoadPlanner(), process_group=self._pg,
                     no_dist=not self._distributed)
        except CheckpointException as exc:  # a BaseException: make it an error that says what failed
            raise CheckpointLoadError(f"cannot load {uri}: {_describe(exc)}") from None
        extra_uri = _join(uri, _EXTRA.format(rank=self.rank))
        try:
            raw = self._storage.read_bytes(extra_uri)
        except FileNotFoundError:
            logger.warning("%s has no extra state for rank %d (saved by fewer ranks)", uri, self.rank)
            extra: dict = {}
        else:
            try:
                extra = load_plain(raw)
            except pickle.UnpicklingError as exc:
                raise CheckpointLoadError(f"cannot load {extra_uri}: it holds more than plain values "
                                          f"(refusing to run code from storage): {exc}".splitlines()[0]) from None
        self.last_restore_seconds = time.perf_counter() - began
        self.restores += 1
        return extra

    # ------------------------------------------------------------------ rotation

    def rotate(self) -> list[str]:
        """Delete checkpoints that are neither among the ``keep`` newest valid ones nor milestones
        (valid, step % keep_every == 0), and invalid directories older than the newest valid
        checkpoint (they can never be resumed from). Never deletes the newest valid checkpoint
        (verified by re-hash unless this process wrote it) or anything newer than it. Only rank
        0 deletes; other ranks return []. Returns the deleted URIs. Runs after every commit.

        Checkpoints older than the newest valid one are judged by presence and size only, to
        avoid reading every checkpoint on every save. A manifest is deleted before its files, so
        an interrupted deletion leaves a directory that reads as a partial save.
        """
        self.wait()
        return self._rotate()

    def _rotate(self) -> list[str]:
        if self.rank != 0:
            return []
        dirs = _step_dirs(self._storage, self.uri)
        newest_valid: Optional[int] = None
        verdicts: list[tuple[int, str, bool]] = []
        for step, uri in dirs:
            if newest_valid is None:
                info = _inspect(self._storage, uri, step, deep=True, trusted=self._trusted)
                if info.valid:
                    newest_valid = step
                    self._trusted[uri] = info.manifest_sha256
            else:
                info = _inspect(self._storage, uri, step, deep=False)
            verdicts.append((step, uri, info.valid))
        if newest_valid is None:
            return []
        kept = 0
        doomed = []
        for step, uri, valid in verdicts:
            if step > newest_valid:
                continue  # newer than the newest valid: maybe a save in progress elsewhere
            if valid:
                kept += 1
                if kept <= self.keep or (self.keep_every and step % self.keep_every == 0):
                    continue
            doomed.append(uri)
        for uri in doomed:
            try:
                self._storage.rm_file(_join(uri, MANIFEST_NAME))
            except FileNotFoundError:
                pass
            self._trusted.pop(uri, None)
            self._storage.rm_tree(uri)
            logger.info("rotated out checkpoint %s", uri)
        return doomed


# --------------------------------------------------------------------------------------------
# CLI helpers (`trainingrun checkpoints URI [--json]`)


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def format_table(infos: Iterable[CheckpointInfo]) -> str:
    """A fixed-width table of checkpoints (step, valid, time, size, model digest prefix, and the
    URI or, for an invalid one, the reason), one per line, with a header."""
    rows = [("STEP", "VALID", "TIME", "SIZE", "MODEL", "URI / REASON")]
    for info in infos:
        rows.append((
            str(info.step),
            "yes" if info.valid else "NO",
            info.time or "-",
            _human_bytes(info.size_bytes),
            (info.model_digest or "-")[:12],
            info.uri if info.valid else f"{info.uri}  ({info.reason})",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in (0, 3) else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


def to_json(infos: Iterable[CheckpointInfo]) -> str:
    """A JSON array of checkpoints, one object per :class:`CheckpointInfo` with all its fields
    (step, uri, time, size_bytes, valid, reason, model_digest, world_size, manifest_sha256)."""
    return json.dumps([dataclasses.asdict(info) for info in infos], indent=2)
