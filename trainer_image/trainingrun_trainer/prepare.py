"""`trainingrun data prepare`: a local folder of text files into shards that `shards.TextBytes` reads, uploaded.

Text files (`*.txt` below SRC, in path order) are joined, one newline between files, into shards of about
`shard_bytes` (`shard-00000.txt`, ...; a file larger than a shard is split across shards), each written to a local
temporary file and uploaded as soon as it is full, so memory stays at one read buffer whatever the data's size.
A destination that already holds shards is refused unless `overwrite`: nothing there is lost by a typo.
"""
from __future__ import annotations

import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .checkpoint.storage import _storage_options

SHARD_NAME = "shard-{:05d}.txt"
READ_BYTES = 1 << 20


class PrepareError(ValueError):
    """SRC or DEST cannot be used as they are; the message says what to change."""


@dataclass
class Prepared:
    shards: list[str]  #: URIs written, in order
    files: int  #: source files read
    bytes: int  #: bytes written (text and separators)


def text_files(source: Path) -> list[Path]:
    if not source.is_dir():
        raise PrepareError(f"SRC {source} is not a directory: name a local folder of .txt files")
    files = sorted(p for p in source.rglob("*.txt") if p.is_file())
    if not files:
        raise PrepareError(f"SRC {source} has no .txt files (searched below it): nothing to prepare")
    return files


def prepare_text(source: Path, destination: str, shard_bytes: int = 64 << 20, overwrite: bool = False,
                 endpoint_url: Optional[str] = None,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> Prepared:
    """Write SRC's text as shards under `destination`; `progress(bytes written, bytes in total)` after each read."""
    from fsspec.core import url_to_fs

    if shard_bytes < 1:
        raise PrepareError(f"--shard-mb must be positive, got a shard size of {shard_bytes} bytes")
    files = text_files(source)
    fs, root = url_to_fs(destination, **_storage_options(destination, endpoint_url, None))
    scheme = destination.split("://", 1)[0] + "://" if "://" in destination else ""
    existing = fs.glob(posixpath.join(root, "shard-*.txt"))
    if existing and not overwrite:
        raise PrepareError(f"DEST {destination} already holds {len(existing)} shards (e.g. {posixpath.basename(existing[0])})"
                           ": choose another DEST, or pass --overwrite to replace them")
    fs.makedirs(root, exist_ok=True)  # a local destination's folder; nothing on object stores
    total = sum(f.stat().st_size for f in files) + len(files) - 1
    written: list[str] = []
    done = 0
    with tempfile.TemporaryDirectory(prefix="trainingrun-prepare-") as scratch:
        shard_path = Path(scratch) / "shard"
        shard = open(shard_path, "wb")
        in_shard = 0

        def upload() -> None:
            nonlocal shard, in_shard
            shard.close()
            target = posixpath.join(root, SHARD_NAME.format(len(written)))
            fs.put_file(str(shard_path), target)
            written.append(scheme + target if scheme and "://" not in target else target)
            shard, in_shard = open(shard_path, "wb"), 0

        def emit(data: bytes) -> None:
            nonlocal in_shard
            while data:
                room = shard_bytes - in_shard
                shard.write(data[:room])
                in_shard += min(room, len(data))
                data = data[room:]
                if in_shard == shard_bytes:
                    upload()

        for number, path in enumerate(files):
            if number:
                emit(b"\n")
                done += 1
            with open(path, "rb") as text:
                while chunk := text.read(READ_BYTES):
                    emit(chunk)
                    done += len(chunk)
                    progress(done, total)
        if in_shard:
            upload()
        shard.close()
    for stale in existing[len(written):] if overwrite else []:
        fs.rm_file(stale)  # shards of the earlier preparation beyond the new count
    return Prepared(written, len(files), total)


__all__ = ["PrepareError", "Prepared", "prepare_text", "text_files", "SHARD_NAME"]
