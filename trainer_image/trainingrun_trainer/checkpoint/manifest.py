"""Inspecting checkpoints: a directory's manifest, its files checked against it, and `verify`."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional

from .layout import (
    FILE_DIGEST_HEX,
    MANIFEST_NAME,
    READABLE_FORMATS,
    STEP_DIR_NAME,
    file_digest_name,
    is_plain_name,
    join_uri,
)
from .records import CheckpointInfo
from .storage import Storage, entry_time, fsspec_options, is_plain_dir, is_plain_file

#: The largest manifest read (bytes); one of a 10,000-rank checkpoint is about 2 MB.
MAX_MANIFEST_BYTES = 64 << 20
#: The most files one manifest may list.
MAX_MANIFEST_FILES = 1_000_000
#: Files of one checkpoint re-hashed at once (each also fetches `storage.FETCH_AHEAD` ranges at once from an object
#: store, so at most this many times that many requests are in flight).
CHECK_THREADS = min(4, os.cpu_count() or 1)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # bool is an int too


def parse_manifest(raw: bytes) -> dict:
    """The manifest's JSON, checked to be one this trainer wrote: every listed file a plain name of its directory, once,
    with a size and its format's file digest (anything else names what is wrong, and the checkpoint is not valid)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    manifest = json.loads(raw)
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    if manifest.get("format_version") not in READABLE_FORMATS or type(manifest.get("format_version")) is not int:
        raise ValueError(
            f"format_version {manifest.get('format_version')!r}, expected one of "
            f"{', '.join(map(str, READABLE_FORMATS))} (written by a newer trainer image?)"
        )
    files = manifest.get("files")
    digest = file_digest_name(manifest["format_version"])
    if (
        not isinstance(files, list)
        or len(files) > MAX_MANIFEST_FILES
        or not all(
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and _is_count(f.get("size"))
            and isinstance(f.get(digest), str)
            and FILE_DIGEST_HEX[digest].fullmatch(f[digest])
            for f in files
        )
    ):
        raise ValueError(f"'files' is not a list of {{path, size, {digest}}}")
    names = [f["path"] for f in files]
    strange = next((name for name in names if not is_plain_name(name) or name == MANIFEST_NAME), None)
    if strange is not None:
        raise ValueError(f"it lists {strange[:80]!r}, which is not a plain file name of its step directory")
    if len(set(names)) != len(names):
        raise ValueError("it lists a file twice")
    if not _is_count(manifest.get("step")):
        raise ValueError("'step' is not a non-negative integer")
    for key in ("time", "model_digest", "config_hash", "torch_version", "run_uid"):
        value = manifest.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= 256 and value.isascii()):
            raise ValueError(f"{key!r} is not a short ASCII string")
    if manifest.get("world_size") is not None and not (_is_count(manifest["world_size"]) and manifest["world_size"]):
        raise ValueError("'world_size' is not a positive integer")
    return manifest


def inspect_step(
    storage: Storage,
    uri: str,
    step: int,
    deep: bool,
    trusted: Optional[Mapping[str, str]] = None,
    tier: Any = None,
    owner: Optional[str] = None,
    partial: bool = False,
) -> CheckpointInfo:
    """Check one step directory. Shallow: manifest readable, every file present with its size.
    Deep: also re-hash every file, unless ``trusted`` maps this uri to this very manifest's sha256
    (this process wrote or verified it; used by rotation only). With a memory ``tier`` (`MemoryTier`), a deep check
    also keeps what it read there, committed when every file matched: the load that follows reads it from memory
    instead of downloading it again. With `owner` (a run's uid), a checkpoint another run wrote is not valid (and its
    files are not read). `partial` (shallow only): a pod's memory copy, which may hold only the files its ranks read
    (a sharded state on more than two pods): a file it lacks is no reason against it, one of another size is."""
    if storage.local:
        listing, (raw, read_error) = storage.listing(uri), _read_manifest(storage, uri)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-manifest") as pool:
            # Both at once: on an object store each is a round trip, which a restore from the memory tier mostly
            # waits for.
            manifest_read = pool.submit(_read_manifest, storage, uri)
            listing = storage.listing(uri)
            raw, read_error = manifest_read.result()
    files = {name: e for name, e in listing.items() if is_plain_file(e)}
    size = sum(int(e.get("size") or 0) for e in files.values())
    newest = max((entry_time(e) for e in files.values()), default="")

    def found(reason: Optional[str], manifest: Optional[dict] = None, manifest_sha: Optional[str] = None):
        """The directory as found: valid when there is no `reason` against it, then with the files it lists."""
        manifest = manifest or {}
        return CheckpointInfo(
            step=step,
            uri=uri,
            time=manifest.get("time") or newest,
            size_bytes=size,
            valid=reason is None,
            reason=reason,
            model_digest=manifest.get("model_digest") or None,
            world_size=manifest.get("world_size"),
            manifest_sha256=manifest_sha,
            format_version=manifest.get("format_version"),
            files={entry["path"]: entry["size"] for entry in manifest["files"]} if reason is None else None,
            run_uid=manifest.get("run_uid") or None,
        )

    if MANIFEST_NAME not in files or (raw is None and read_error is None):
        return found("no manifest (partial save)")
    if read_error is not None or raw is None:
        return found(f"manifest unreadable: {read_error}")
    manifest_sha = hashlib.sha256(raw).hexdigest()
    try:
        manifest = parse_manifest(raw)
    except Exception as exc:  # unreadable JSON, wrong format version
        return found(f"manifest unreadable: {exc}")
    if manifest["step"] != step:
        return found(f"manifest is for step {manifest['step']}", manifest, manifest_sha)
    if owner and manifest.get("run_uid") and manifest["run_uid"] != owner:
        return found(f"written by another run (uid {manifest['run_uid']})", manifest, manifest_sha)
    for entry in manifest["files"]:
        name = entry["path"]
        if name not in files:
            if partial and not deep:
                continue
            return found(f"missing file {name}", manifest, manifest_sha)
        listed = files[name].get("size")
        if listed is not None and int(listed) != entry["size"]:
            return found(f"size mismatch in {name}", manifest, manifest_sha)
    if deep and not (trusted and trusted.get(uri) == manifest_sha):
        kept = tier.begin(step, sum(entry["size"] for entry in manifest["files"])) if tier is not None else None
        reason: Optional[str] = "interrupted"
        try:
            digest = file_digest_name(manifest["format_version"])
            entries = manifest["files"]

            def check(entry: dict) -> Optional[str]:
                return _check(storage, uri, entry, digest, tier.copy(kept, entry["path"]) if kept is not None else None)

            # Files at once: hashing releases the interpreter lock, and so do reads and the tier's writes. One at a time,
            # a restore from storage waited for each file's read, hash and copy into memory in turn.
            with ThreadPoolExecutor(
                min(CHECK_THREADS, len(entries)) or 1, thread_name_prefix="checkpoint-check"
            ) as pool:
                reason = next((why for why in pool.map(check, entries) if why is not None), None)
        finally:
            if kept is not None:
                tier.commit(step, raw) if reason is None else tier.discard(step)
        if reason is not None:
            return found(reason, manifest, manifest_sha)
    return found(None, manifest, manifest_sha)


def _read_manifest(storage: Storage, uri: str) -> tuple[Optional[bytes], Optional[Exception]]:
    """(the manifest's bytes, None), (None, None) when there is none, or (None, the storage error)."""
    try:
        return storage.read_bytes(join_uri(uri, MANIFEST_NAME), limit=MAX_MANIFEST_BYTES + 1), None
    except FileNotFoundError:
        return None, None
    except Exception as exc:  # said by inspect_step when the listing holds a manifest
        return None, exc


def _check(storage: Storage, uri: str, entry: dict, digest: str, copy: Any) -> Optional[str]:
    """Why the file of a manifest entry does not match it by its size and its `digest` (None: it does); `copy` keeps
    what was read."""
    name = entry["path"]
    try:
        got_size, got_digest = storage.digest(join_uri(uri, name), digest, copy, size=entry["size"])
    except FileNotFoundError:
        got_size, got_digest = None, None
    except BaseException:
        if copy is not None:
            copy.abandon()
        raise
    reason = (
        "missing file"
        if got_size is None
        else "size mismatch in"
        if got_size != entry["size"]
        else f"{digest} mismatch in"
        if got_digest != entry[digest]
        else None
    )
    if copy is not None:
        copy.close(digest, got_digest) if reason is None else copy.abandon()
    return None if reason is None else f"{reason} {name}"


def list_step_dirs(storage: Storage, base_uri: str) -> list[tuple[int, str]]:
    """(step, uri) of every step-* directory below base_uri, newest step first."""
    found = []
    for name, entry in storage.listing(base_uri).items():
        match = STEP_DIR_NAME.fullmatch(name)
        if match and is_plain_dir(entry):
            found.append((int(match.group(1)), join_uri(base_uri, name)))
    return sorted(found, reverse=True)


def verify(
    uri: str, *, endpoint_url: Optional[str] = None, storage_options: Optional[Mapping] = None
) -> CheckpointInfo:
    """Re-hash the files of one checkpoint directory (``<base>/step-NNNNNNNN``) against its
    manifest and return what was found; ``valid`` False with a ``reason`` when they differ."""
    uri = uri.rstrip("/")
    match = STEP_DIR_NAME.fullmatch(posixpath.basename(uri))
    if not match:
        raise ValueError(f"{uri!r} is not a checkpoint directory (expected .../step-NNNNNNNN)")
    storage = Storage(uri, fsspec_options(uri, endpoint_url, storage_options))
    return inspect_step(storage, uri, int(match.group(1)), deep=True)


# --------------------------------------------------------------------------------------------
