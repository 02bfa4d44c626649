"""`trainingrun data prepare`: a local folder into shards that `shards.TextBytes` or `shards.ImageShards` read, uploaded.

- text: the `*.txt` files below SRC, in path order, joined with one newline between files into shards of about
  `shard_bytes` (`shard-00000.txt`, ...; a file larger than a shard is split across shards).
- images: the image files below SRC, in path order, as WebDataset tar shards (`shard-00000.tar`, ...) of about
  `shard_bytes`, one sample per image (`<8-digit index>.<ext>`, the file's own bytes: nothing is re-encoded).

Each shard is written to a local temporary file and uploaded as soon as it is full, so memory stays small whatever
the data's size. A destination that already holds shards is refused unless `overwrite`: nothing there is lost by a
typo; with `overwrite`, shards beyond the new count are removed.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .checkpoint.storage import fsspec_options

SHARD_NAME = "shard-{:05d}.{}"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm")
READ_BYTES = 1 << 20


class PrepareError(ValueError):
    """SRC or DEST cannot be used as they are; the message says what to change."""


@dataclass
class Prepared:
    shards: list[str]  #: URIs written, in order
    files: int  #: source files read
    bytes: int  #: bytes of the source files (and, for text, the separators)
    skipped_links: int = 0  #: links below SRC to files outside it, not read


def source_files(source: Path, kind: str) -> tuple[list[Path], int]:
    """The files of `kind` below SRC, in path order, and how many links below it were skipped because they lead out
    of it: a link named like data (`notes.txt` to a credentials file) would have put its target into shards that are
    then uploaded. Links to directories are not followed; links to files inside SRC are read."""
    if not source.is_dir():
        raise PrepareError(f"SRC {source} is not a directory: name a local folder of {kind} files")
    wanted = (".txt",) if kind == "text" else IMAGE_EXTENSIONS
    inside = source.resolve()
    files, skipped = [], 0
    for folder, _, names in os.walk(source):  # never into a linked directory
        for name in names:
            path = Path(folder) / name
            if path.suffix.lower() not in wanted:
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(inside):
                skipped += 1
            elif path.is_file():
                files.append(path)
    if not files:
        raise PrepareError(f"SRC {source} has no {' or '.join(wanted)} files (searched below it): nothing to prepare")
    return sorted(files), skipped


class _Destination:
    """Shards uploaded one by one under `destination`, refusing to replace earlier ones unless `overwrite`."""

    def __init__(self, destination: str, extension: str, overwrite: bool, endpoint_url: Optional[str]):
        from fsspec.core import url_to_fs

        self.destination, self.extension = destination, extension
        self.fs, self.root = url_to_fs(destination, **fsspec_options(destination, endpoint_url, None))
        self.scheme = destination.split("://", 1)[0] + "://" if "://" in destination else ""
        self.existing = self.fs.glob(posixpath.join(self.root, f"shard-*.{extension}"))
        if self.existing and not overwrite:
            raise PrepareError(
                f"DEST {destination} already holds {len(self.existing)} shards (e.g. "
                f"{posixpath.basename(self.existing[0])}): choose another DEST, or pass --overwrite "
                "to replace them"
            )
        self.fs.makedirs(self.root, exist_ok=True)  # a local destination's folder; nothing on object stores
        self.written: list[str] = []

    def upload(self, local: Path) -> None:
        target = posixpath.join(self.root, SHARD_NAME.format(len(self.written), self.extension))
        self.fs.put_file(str(local), target)
        self.written.append(self.scheme + target if self.scheme and "://" not in target else target)

    def finish(self) -> list[str]:
        for stale in self.existing[len(self.written) :]:
            self.fs.rm_file(stale)  # shards of an earlier preparation beyond the new count
        return self.written


def prepare(
    source: Path,
    destination: str,
    kind: str = "text",
    shard_bytes: int = 64 << 20,
    overwrite: bool = False,
    endpoint_url: Optional[str] = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> Prepared:
    """Write SRC's text or images as shards under `destination`; `progress(bytes done, bytes in total)` as it goes."""
    if kind not in ("text", "images"):
        raise PrepareError(f"--kind must be text or images, got {kind!r}")
    if shard_bytes < 1:
        raise PrepareError(f"--shard-mb must be positive, got a shard size of {shard_bytes} bytes")
    files, skipped_links = source_files(source, kind)
    target = _Destination(destination, "txt" if kind == "text" else "tar", overwrite, endpoint_url)
    with tempfile.TemporaryDirectory(prefix="trainingrun-prepare-") as scratch:
        write = _text_shards if kind == "text" else _image_shards
        total = write(files, Path(scratch) / "shard", shard_bytes, target.upload, progress)
    return Prepared(target.finish(), len(files), total, skipped_links)


def _text_shards(
    files: list[Path],
    scratch: Path,
    shard_bytes: int,
    upload: Callable[[Path], None],
    progress: Callable[[int, int], None],
) -> int:
    total = sum(f.stat().st_size for f in files) + len(files) - 1
    shard, in_shard, done = open(scratch, "wb"), 0, 0

    def emit(data: bytes) -> None:
        nonlocal shard, in_shard
        while data:
            room = shard_bytes - in_shard
            shard.write(data[:room])
            in_shard += min(room, len(data))
            data = data[room:]
            if in_shard == shard_bytes:
                shard.close()
                upload(scratch)
                shard, in_shard = open(scratch, "wb"), 0

    for number, path in enumerate(files):
        if number:
            emit(b"\n")
            done += 1
        with open(path, "rb") as text:
            while chunk := text.read(READ_BYTES):
                emit(chunk)
                done += len(chunk)
                progress(done, total)
    shard.close()
    if in_shard:
        upload(scratch)
    return total


def _image_shards(
    files: list[Path],
    scratch: Path,
    shard_bytes: int,
    upload: Callable[[Path], None],
    progress: Callable[[int, int], None],
) -> int:
    import tarfile

    total, done = sum(f.stat().st_size for f in files), 0
    shard: Optional[tarfile.TarFile] = None
    for number, path in enumerate(files):
        if shard is None:
            shard = tarfile.open(scratch, "w", format=tarfile.USTAR_FORMAT)
        info = tarfile.TarInfo(f"{number:08d}{path.suffix.lower()}")
        info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644  # no owner or time: the same bytes each time
        with open(path, "rb") as image:
            shard.addfile(info, image)
        done += info.size
        progress(done, total)
        if shard.fileobj.tell() >= shard_bytes:
            shard.close()
            upload(scratch)
            shard = None
    if shard is not None:
        shard.close()
        upload(scratch)
    return total


def prepare_text(source: Path, destination: str, **options: Any) -> Prepared:
    return prepare(source, destination, "text", **options)


__all__ = ["PrepareError", "Prepared", "prepare", "prepare_text", "source_files", "SHARD_NAME"]
