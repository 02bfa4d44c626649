"""What a shard is, as the datasets of this package read it: the layouts' constants, a shard's description, the walk
over a WebDataset tar's headers, and the error for a shard that is not what it should be."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainingrun_api import builtin_args

LLMC_HEADER_BYTES = 1024
LLMC_MAGICS = {20240520: "uint16", 20240801: "uint32"}
DTYPES = builtin_args.TOKEN_DTYPES
LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in DTYPES}
#: Where blocks are cached when `cache_dir` is not given.
CACHE_ENV = "TRAININGRUN_DATA_CACHE"
#: The longest GNU long-name or pax header read (bytes): a path, a few records; anything longer is not a sample's.
MAX_EXTENDED_HEADER_BYTES = 64 << 10


class DataError(ValueError):
    """A shard that is not what the dataset expects (truncated, wrong format): retrying cannot help."""


@dataclass(frozen=True)
class Shard:
    uri: str
    path: str  #: the filesystem's path for it
    size: int  #: bytes
    version: str  #: ETag or mtime: a replaced shard gets new cache entries
    offset: int  #: byte where the tokens start (after an llm.c header)
    dtype: str
    tokens: int


def read_part(path: str, low: int, high: int) -> bytes:
    with open(path, "rb") as part:
        part.seek(low)
        return part.read(high - low)


def tar_samples(shard: Shard, read: Any) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """Walk a tar's headers (ustar, GNU long names, pax paths): samples by key, in the order they appear."""
    import tarfile

    samples: dict[str, dict[str, tuple[int, int]]] = {}
    offset, long_name = 0, None
    while True:
        if offset + 512 > shard.size:
            raise DataError(
                f"{shard.uri}: ends at byte {shard.size} without tar's end-of-archive marker: truncated? "
                "Write the shard again"
            )
        block = read(offset, offset + 512)
        if block == bytes(512):
            break  # the end-of-archive marker
        try:
            header = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as error:
            raise DataError(
                f"{shard.uri}: no tar header at byte {offset} ({error}): not a WebDataset tar shard, or a damaged one"
            ) from None
        data = offset + 512
        if header.size < 0:  # base-256 sizes may be negative: -512 would read this header again, forever
            raise DataError(
                f"{shard.uri}: member {header.name[:100]!r} at byte {offset} says it has {header.size} bytes: a "
                "damaged or hostile tar; write the shard again"
            )
        end = data + (header.size + 511) // 512 * 512
        if data + header.size > shard.size:
            raise DataError(
                f"{shard.uri}: member {header.name} at byte {offset} says {header.size} bytes, past the "
                f"shard's end ({shard.size} bytes): truncated?"
            )
        if header.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
            if header.size > MAX_EXTENDED_HEADER_BYTES:
                raise DataError(
                    f"{shard.uri}: the {'long-name' if header.type == tarfile.GNUTYPE_LONGNAME else 'pax'} header at "
                    f"byte {offset} says {header.size} bytes, more than the {MAX_EXTENDED_HEADER_BYTES} a sample's "
                    "name needs: a damaged or hostile tar; write the shard again"
                )
            text = read(data, data + header.size)
            if header.type == tarfile.GNUTYPE_LONGNAME:
                long_name = text.rstrip(b"\0").decode("utf-8", "surrogateescape")
            else:
                for record in text.decode("utf-8", "surrogateescape").splitlines():
                    _, _, field = record.partition(" ")
                    if field.startswith("path="):
                        long_name = field[5:]
        elif header.isfile():
            name, long_name = long_name or header.name, None
            base = posixpath.basename(name)
            key, dot, ext = base.partition(".")
            if dot and not base.startswith("."):
                samples.setdefault(posixpath.join(posixpath.dirname(name), key), {})[ext.lower()] = (data, header.size)
        offset = end
    return list(samples.items())


def first_line(error: BaseException) -> str:
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return text or type(error).__name__
