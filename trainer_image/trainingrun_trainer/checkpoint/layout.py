"""How a checkpoint looks on storage: its names, the format version and digests, and which of its files a rank
reads. The records that describe one are in `records`, the errors in `errors`."""

from __future__ import annotations

import hashlib
import logging
import re
from datetime import datetime, timezone
from typing import Any, Collection, Optional

import xxhash

from trainingrun_api.contract import rfc3339

logger = logging.getLogger("trainingrun.checkpoint")

#: Version of the checkpoint format that saves write. 4: the manifest's digest of each file is its xxh3_128;
#: 3: tensors are stored as their bytes (`tensor_files`).
FORMAT_VERSION = 4
#: Versions readers load. 3 and before: each file's digest is its sha256; 2: tensors as DCP's torch.save archives,
#: each rank's ``extra`` an entry of DCP's state dict; 1: each rank's ``extra`` was a file of its own
#: (``extra-rank-<r>.pt``).
READABLE_FORMATS = (1, 2, 3, 4)
#: Each file digest a manifest may record: its name (the manifest entry's key) and its hex form. xxh3_128 (format 4)
#: hashes at memory speed, about ten times sha256's, so it is computed while the bytes stream; it detects
#: corruption, which is all sha256 did too: whoever may rewrite a file may rewrite the manifest beside it.
FILE_DIGEST_HEX = {"xxh3_128": re.compile(r"[0-9a-f]{32}", re.ASCII), "sha256": re.compile(r"[0-9a-f]{64}", re.ASCII)}


def file_digest_name(format_version: int) -> str:
    """The file digest manifests of this format record."""
    return "xxh3_128" if format_version >= 4 else "sha256"


#: The file digest saves record.
FILE_DIGEST = file_digest_name(FORMAT_VERSION)


def file_hasher(name: str) -> Any:
    """A new hash object (update, hexdigest) of the file digest `name`."""
    return xxhash.xxh3_128() if name == "xxh3_128" else hashlib.sha256()


#: Name of the commit marker inside a checkpoint directory.
MANIFEST_NAME = "manifest.json"
#: DCP's metadata file, written by rank 0.
METADATA_NAME = ".metadata"
#: How a rank's file of replicated items ends (``__<rank>_replicated.distcp``: a sharded state on more than two pods,
#: `tensor_files.write_rank_file`, `mirroring`).
REPLICATED_SUFFIX = "_replicated.distcp"
#: Beside the step directories: how often the run's training processes started (`CheckpointStore.record_start`).
STARTS_NAME = "starts.json"
#: A step directory's name. Matched whole (`fullmatch`) and ASCII only: `\\d` alone also takes other scripts' digits,
#: which int() reads, and `$` a trailing newline.
STEP_DIR_NAME = re.compile(r"step-([0-9]{1,19})", re.ASCII)
#: A file a manifest may list: a plain name inside its step directory (no separator, no "." or "..").
_PLAIN_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.-]{1,255}", re.ASCII)
#: A DCP data file's name, by the rank that wrote it (``__<rank>_<n>.distcp``, ``__<rank>_replicated.distcp``).
_WRITTEN_BY = re.compile(r"__([0-9]{1,9})_[A-Za-z0-9_.-]*", re.ASCII)
#: A rank's ``extra`` in DCP's state dict (format 2): one value, the bytes of torch.save, so that DCP needs
#: nothing of its structure to load it and only that rank loads it.
EXTRA_ENTRY = "extra-rank-{rank}"
#: A rank's ``extra`` in format 1: its own file beside DCP's (still read, never written).
LEGACY_EXTRA_FILE = "extra-rank-{rank}.pt"
#: How much of a file one read hashes at a time.
HASH_CHUNK_BYTES = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------


def now_rfc3339() -> str:
    return rfc3339(datetime.now(timezone.utc), fraction=True)


def step_dir_name(step: int) -> str:
    """Directory name of a step's checkpoint: ``step-00000100``."""
    return f"step-{step:08d}"


def files_a_rank_reads(files: Collection[str], saved_by: Optional[int], world_size: int, rank: int) -> set[str]:
    """The files of a checkpoint (`files`, written by `saved_by` ranks) that `rank` of `world_size` reads to restore it:
    all of them, but that a sharded state saved by as many ranks with its replicated items apart (`mirroring`) is read
    from each rank's own files (``__<rank>_*``), the replicated items and the metadata."""
    if saved_by != world_size or not any(name.endswith(REPLICATED_SUFFIX) for name in files):
        return set(files)
    own = f"__{rank}_"
    return {name for name in files if name == METADATA_NAME or name.endswith(REPLICATED_SUFFIX) or name.startswith(own)}


def writing_rank(name: str) -> int:
    """The rank that wrote the checkpoint file `name` (``__<rank>_*``); 0, the coordinator's, for the metadata and any
    other name."""
    match = _WRITTEN_BY.fullmatch(name)
    return int(match.group(1)) if match else 0


def is_plain_name(name: object) -> bool:
    """Whether `name` may name a file of a step directory (what a manifest lists, what DCP's metadata points at)."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def join_uri(base: str, name: str) -> str:
    """`name` below the URI `base` (one "/" between, whatever `base` ends with)."""
    return base.rstrip("/") + "/" + name
