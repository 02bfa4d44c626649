"""fsspec storage for checkpoints: options per scheme, listing and the few operations the store needs."""

from __future__ import annotations

import base64
import errno
import os
import posixpath
import re
import shutil
import stat
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from itertools import islice
from typing import Any, BinaryIO, Iterator, Mapping, Optional

from fsspec.core import url_to_fs

from .layout import HASH_CHUNK_BYTES, file_hasher

#: Ranges of one file in object storage fetched at once when it is hashed (each `HASH_CHUNK_BYTES` bytes).
FETCH_AHEAD = 8
#: Chunks read (each `HASH_CHUNK_BYTES` bytes) that may wait to be written to the memory tier's copy.
COPY_AHEAD = 4


def fsspec_options(uri: str, endpoint_url: Optional[str], storage_options: Optional[Mapping]) -> dict:
    """The fsspec options for `uri`: the spec's `storage_options`, with `endpoint_url` (else S3's
    AWS_ENDPOINT_URL) for s3:// and gs://; an endpoint for another scheme is a ValueError."""
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


def entry_time(entry: Mapping) -> str:
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


def _open_regular(path: str) -> BinaryIO:
    """A local file opened for reading, if it is a regular file (OSError otherwise): a named pipe in a checkpoint
    folder blocked every read of it for ever, and a device never ends. Opened without blocking, then checked."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _crc32c() -> Any:
    """A CRC32C checksum (google-crc32c), or None where it is not installed (the manifest's digests still guard every
    read)."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c.Checksum()


class Storage:
    """The few fsspec operations the store needs, on URIs below one base URI."""

    def __init__(self, uri: str, options: Mapping):
        self.options = dict(options)
        self.fs, _ = url_to_fs(uri, **self.options)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")
        self.gcs = protocol in ("gs", "gcs")

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

    def read_bytes(self, uri: str, limit: Optional[int] = None) -> bytes:
        """The file's bytes; with `limit`, at most that many (a caller that refuses longer files reads limit + 1)."""
        if self.local:
            with _open_regular(self._path(uri)) as file:
                return file.read() if limit is None else file.read(limit)
        if limit is None:
            return self.fs.cat_file(self._path(uri))
        return self.fs.cat_file(self._path(uri), start=0, end=limit)

    def digest(self, uri: str, name: str, copy: Any = None, size: Optional[int] = None) -> tuple[int, str]:
        """(size, file digest `name`: xxh3_128 or sha256) of a file, read once; `copy` (a memory tier's `TierCopy`)
        gets every byte read. On an object store, given the file's listed `size`, `FETCH_AHEAD` ranges are fetched at
        once (hashed in order)."""
        digest = file_hasher(name)
        read = 0
        chunks = self._ranges(uri, size) if size is not None and not self.local else self._stream(uri)
        if copy is None:
            for chunk in chunks:
                digest.update(chunk)
                read += len(chunk)
            return read, digest.hexdigest()
        # The copy is written by a thread of its own, up to COPY_AHEAD chunks behind: a write into memory (tmpfs pages
        # allocated) took longer than reading and hashing the same bytes, and both release the interpreter lock.
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-tier-copy") as writer:
            copying: deque[Future] = deque()
            for chunk in chunks:
                digest.update(chunk)
                read += len(chunk)
                copying.append(writer.submit(copy.write, chunk))
                if len(copying) > COPY_AHEAD:
                    copying.popleft().result()
            for written in copying:
                written.result()
        return read, digest.hexdigest()

    def _stream(self, uri: str) -> Iterator[bytes]:
        path = self._path(uri)
        with _open_regular(path) if self.local else self.fs.open(path, "rb", block_size=HASH_CHUNK_BYTES) as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                yield chunk

    def _ranges(self, uri: str, size: int) -> Iterator[bytes]:
        """The file's bytes up to `size`, in order, fetched `FETCH_AHEAD` ranges at a time: one stream would wait a
        round trip per block, with the link idle. Stops after a short range (the file is shorter than `size`), and
        ends with what lies beyond `size` (nothing, unless the file is longer)."""
        path = self._path(uri)
        starts = iter(range(0, size, HASH_CHUNK_BYTES))
        with ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="checkpoint-fetch") as pool:

            def fetch(start: int) -> tuple[int, Future]:
                end = min(start + HASH_CHUNK_BYTES, size)
                return end - start, pool.submit(self.fs.cat_file, path, start=start, end=end)

            beyond = pool.submit(self.fs.cat_file, path, start=size, end=size + 1)
            pending = deque(fetch(start) for start in islice(starts, FETCH_AHEAD))
            while pending:
                wanted, future = pending.popleft()
                chunk = future.result()
                yield chunk
                if len(chunk) < wanted:
                    for _, later in pending:
                        later.cancel()
                    return
                start = next(starts, None)
                if start is not None:
                    pending.append(fetch(start))
            try:
                yield beyond.result()
            except Exception:  # noqa: BLE001 - a range past the end is refused by some stores (S3: 416); the
                pass  # listing's size, which inspect_step compared before hashing, says the same

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

    def upload(self, path: str, uri: str, digest_name: str, digest: str) -> None:
        """Copy the local file `path` to `uri` (file://: then fsync it), hashing the bytes as they go: when they are not
        the ones the manifest's `digest` names (the memory copy changed while it was read), what was written is removed
        and OSError raised, so no manifest is ever written over them."""
        target = self._path(uri)
        hasher, checksum = file_hasher(digest_name), _crc32c() if self.gcs else None
        buffer = bytearray(HASH_CHUNK_BYTES)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(path, "rb") as source, open(target, "wb") if self.local else self.fs.open(target, "wb") as out:
            while read := source.readinto(buffer):
                chunk = memoryview(buffer)[:read]
                hasher.update(chunk)
                if checksum is not None:
                    checksum.update(bytes(chunk))
                out.write(chunk)
            if self.local:
                out.flush()
                os.fsync(out.fileno())
        sent = hasher.hexdigest()
        if sent != digest:
            try:
                self.rm_file(uri)
            except OSError:
                pass  # no manifest lists it: the step's next copy clears it
            raise OSError(
                f"{uri}: the bytes copied have {digest_name} {sent}, the manifest says {digest[:64]}: the memory copy "
                "changed while it was copied; not committed"
            )
        if checksum is not None:
            self._check_crc32c(uri, target, checksum)

    def _check_crc32c(self, uri: str, target: str, checksum: Any) -> None:
        """Raise OSError unless GCS holds, by its own CRC32C of what it received, the bytes sent (`checksum`, computed
        as they went). gcsfs checks uploads only with crcmod, whose pure-Python fallback runs at a few MB/s;
        google-crc32c runs at memory speed. (S3 needs no such check: botocore sends a CRC32 with every upload, which
        the server verifies.)"""
        sent = base64.b64encode(checksum.digest()).decode("ascii")
        self.fs.invalidate_cache(target)
        stored = self.fs.info(target).get("crc32c")
        # A GCS-compatible store that keeps no CRC32C is let be: the manifest's digests still guard every read.
        if stored is not None and stored != sent:
            raise OSError(
                f"{uri}: GCS computed CRC32C {str(stored)[:16]} of the upload, but {sent} was sent: damaged in transit"
            )

    def rm_file(self, uri: str) -> None:
        """Delete one file (or link: never what it points at). On file://, its directory is opened without following
        a link, so a step directory replaced by a link into another run deletes nothing there."""
        path = self._path(uri)
        if not self.local:
            self.fs.rm_file(path)
            return
        directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.unlink(os.path.basename(path), dir_fd=directory)
        finally:
            os.close(directory)

    def rm_tree(self, uri: str) -> None:
        """Delete a directory and what it holds; on file://, links inside are removed, never followed, and a link in
        its place is refused (OSError)."""
        path = self._path(uri)
        if self.local:
            shutil.rmtree(path)  # refuses a link; unlinks the links inside (fd-based on Linux)
        else:
            self.fs.rm(path, recursive=True)


def is_plain_file(entry: Mapping) -> bool:
    """A regular file: never a link (file:// lists one as "other"), whatever it points at."""
    return entry.get("type", "file") == "file" and not entry.get("islink")


def is_plain_dir(entry: Mapping) -> bool:
    """A directory (an object store's prefix): never a link to one."""
    return entry.get("type") == "directory" and not entry.get("islink")


# --------------------------------------------------------------------------------------------


#: Below a run's checkpoint URI: a random token that names this storage for as long as it exists. A checkpoint kept
#: in node memory is trusted only under the token it was made under (`MemoryTier.origin`): after the folder is deleted
#: or replaced, memory from before is never resumed, while memory ahead of storage in a live run still is.
STORAGE_ID_NAME = "trainingrun-storage-id"
_TOKEN = re.compile(r"[0-9a-f]{32}")


def storage_identity(storage: Storage, uri: str) -> Optional[str]:
    """The token of the storage at `uri`, made and written there when it has none (or an unreadable one); None when
    storage cannot be read or written (then nothing in memory can be trusted to be its)."""
    target = posixpath.join(uri.rstrip("/"), STORAGE_ID_NAME)
    try:
        try:
            held = storage.read_bytes(target, limit=64).decode("ascii", "replace").strip()
        except FileNotFoundError:
            held = ""
        if _TOKEN.fullmatch(held):
            return held
        token = uuid.uuid4().hex
        if storage.local:
            os.makedirs(os.path.dirname(storage._path(target)), exist_ok=True)
        storage.write_bytes(target, token.encode(), atomic=True)
        return token
    except Exception:  # noqa: BLE001 - each fsspec backend raises its own kinds: unreachable either way
        return None
