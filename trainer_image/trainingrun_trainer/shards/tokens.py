"""Token shards in object storage (`TokenShards`): windows of tokens read by byte range through a block cache shared
by a node's ranks and DataLoader workers (the package's docstring has the layouts)."""

from __future__ import annotations

import bisect
import hashlib
import os
import posixpath
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from trainingrun_api import builtin_args

from ..background import give_way_to_training
from ..checkpoint.errors import StorageUnavailable
from ..checkpoint.storage import fsspec_options
from ..data import checked_index, split_id
from .format import (
    CACHE_ENV,
    LITTLE_ENDIAN,
    LLMC_HEADER_BYTES,
    LLMC_MAGICS,
    DataError,
    Shard,
    first_line,
    read_part,
)

_WINDOW_TAG = 4  # [seed, tag, split, index]: a shard window (data.py's tags are 1-3)


class TokenShards(Dataset):
    """Windows of pre-tokenized shards: `{"tokens": LongTensor[context_length + 1]}`.

    Args:
        uri: a directory (every file matching `pattern` below it, in name order) or one file.
        context_length: tokens the model sees; each window holds one more (the last target).
        dtype: token width of headerless shards: uint16 (GPT-2's 50,257 tokens fit) or uint32.
        pattern: file names to read below a directory.
        vocab_size: when given, every window is checked to hold only tokens below it (a wrong dtype shows here).
        num_samples: items per epoch (default: the split's tokens / (context_length + 1), about one pass). Item i is
            always the same window (chosen at random from the seed and i, so windows may overlap and some tokens are
            never in one): later epochs serve the same windows in a new order, not fresh ones. Give more items for
            more distinct windows per epoch.
        eval_fraction: the last part of each shard's tokens that is the eval split, never trained on: 0 holds none
            out (for a run whose eval.dataset is its own), 1 makes all of it eval (what an eval.dataset gets unless
            it sets one).
        seed: chooses the windows.
        split: "train" or "eval" (the trainer passes it).
        cache_dir: the block cache (default $TRAININGRUN_DATA_CACHE, else a directory in the system's temp dir).
        block_bytes: bytes fetched per range request and cached per file.
        endpoint_url: an S3-compatible endpoint for s3:// (default AWS_ENDPOINT_URL), or a GCS endpoint for gs://.
        read_ahead: items whose blocks are fetched into the cache, in background threads, before the DataLoader asks
            for them (the trainer wraps its sampler in sampling.read_ahead); 0 turns it off.
        fetch_threads: how many of those fetches are in flight at once. Storage latency, not bandwidth, bounds a
            cold start: the first batch needs a block per item (32 one-MB blocks through a 30 ms link: 0.35 s with 4
            threads, 0.14 s with 16). Also how many shards' headers are read at once when the dataset is built
            (32 shards through a 30 ms link: 1.13 s one after another, 0.17 s with 16).
    """

    def __init__(
        self,
        uri: str,
        context_length: int = 64,
        dtype: str = "uint16",
        pattern: str = "*.bin",
        vocab_size: Optional[int] = None,
        num_samples: Optional[int] = None,
        eval_fraction: float = 0.05,
        seed: int = 0,
        split: str = "train",
        cache_dir: Optional[str] = None,
        block_bytes: int = 1 << 20,
        endpoint_url: Optional[str] = None,
        read_ahead: int = 512,
        fetch_threads: int = 16,
    ):
        builtin_args.require(
            "trainingrun_trainer.shards.TokenShards", uri=uri, context_length=context_length, dtype=dtype,
            pattern=pattern, vocab_size=vocab_size, num_samples=num_samples, eval_fraction=eval_fraction, seed=seed,
            split=split, cache_dir=cache_dir, block_bytes=block_bytes, endpoint_url=endpoint_url,
            read_ahead=read_ahead, fetch_threads=fetch_threads,
        )  # fmt: skip
        self.uri, self.context_length, self.dtype, self.pattern = uri.rstrip("/") or uri, context_length, dtype, pattern
        self.vocab_size, self.eval_fraction, self.seed, self.split = vocab_size, float(eval_fraction), seed, split
        self.block_bytes, self.read_ahead, self.fetch_threads = block_bytes, read_ahead, fetch_threads
        self._cache_keys: dict[str, str] = {}  #: per shard URI: its blocks' name in the cache
        self._in_cache: set[tuple[str, int]] = set()  #: blocks this process knows are in the cache
        #: Items' byte ranges the read-ahead found, until the item is read (choosing a window costs ~50 us).
        self._ranges: dict[int, tuple[Shard, int, int]] = {}
        self._split_id = split_id(split)
        self._options = fsspec_options(uri, endpoint_url, None)
        self._start_process_state()
        self.cache = Path(cache_dir or os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "trainingrun-data")
        self.shards = self._discover()
        self._regions = [self._region(shard) for shard in self.shards]  # (first token, windows) per shard
        self._ends = np.cumsum([windows for _, windows in self._regions]).tolist()
        self.windows = self._ends[-1] if self._ends else 0
        if not self.windows:
            raise DataError(self._nothing_in_split())
        self.num_samples = self._samples_per_epoch() if num_samples is None else num_samples

    def _nothing_in_split(self) -> str:
        largest = max((s.tokens for s in self.shards), default=0)
        return (
            f"{self.uri}: no shard holds a window of context_length + 1 = {self.context_length + 1} tokens in its "
            f"{self.split} split (the largest has {largest} tokens, {self.eval_fraction:g} of each is eval): use a "
            "shorter context_length, a different eval_fraction or more data"
        )

    def _samples_per_epoch(self) -> int:
        """About one pass over the split's tokens."""
        split_tokens = sum(windows + self.context_length for _, windows in self._regions if windows)
        return max(1, split_tokens // (self.context_length + 1))

    # ------------------------------------------------------------ finding the shards

    def _filesystem(self) -> Any:
        """A filesystem of this process's own (async clients such as gcsfs and s3fs do not survive a fork)."""
        self._in_this_process()
        with self._lock:  # the read-ahead threads ask for it too
            if self._fs is None:
                from fsspec.core import url_to_fs

                self._fs, _ = url_to_fs(self.uri, skip_instance_cache=True, **self._options)
            return self._fs

    #: What belongs to one process: a DataLoader worker, forked or spawned, starts its own.
    _PROCESS_STATE = ("_fs", "_fetching", "_lock", "_pid")
    _fs: Any  #: the storage client (None until first asked for)
    #: Blocks being fetched by some thread of this process, each set when its fetch ends: the read-ahead threads
    #: and the reader wait for a fetch in flight instead of fetching the same block again.
    _fetching: dict[tuple[str, int], threading.Event]
    _lock: threading.Lock
    _pid: int

    def _start_process_state(self) -> None:
        self._fs = None
        self._fetching = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()  #: the process the above belong to

    def _in_this_process(self) -> None:
        """In a DataLoader worker, forget the state of the process it was forked from: the threads that would release
        its lock, end its fetches in flight (a worker forked while the read-ahead fetched would wait for them
        forever) or run its storage client's event loop are not in this process. A worker is one thread, and the
        process that built the dataset never gets here with another pid, so this needs no lock."""
        if self._pid != os.getpid():
            self._start_process_state()

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in self._PROCESS_STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_process_state()

    def _discover(self) -> list[Shard]:
        fs = self._filesystem()
        root = fs._strip_protocol(self.uri)
        scheme = self.uri.split("://", 1)[0] + "://" if "://" in self.uri else ""
        try:
            info = fs.info(root)
            if info.get("type") == "file":
                entries = {info["name"]: info}
            else:
                entries = fs.glob(posixpath.join(root, self.pattern), detail=True)
        except FileNotFoundError:
            entries = {}
        except Exception as error:  # each backend raises its own kinds
            raise StorageUnavailable(f"cannot list {self.uri}: {first_line(error)}") from error
        files = sorted((name, e) for name, e in entries.items() if e.get("type", "file") == "file")
        if not files:
            raise DataError(
                f"{self.uri}: no files matching {self.pattern!r}: check the URI (and that the shards were "
                "uploaded, e.g. with `trainingrun data prepare`)"
            )

        def shard(file: tuple[str, dict[str, Any]]) -> Shard:
            name, entry = file
            return self._shard(scheme + name if scheme and "://" not in name else name, name, entry)

        if not self.headers or len(files) == 1:
            return [shard(file) for file in files]
        # Each shard's header is a request: one after another, a start (every restart's too) waited the storage
        # latency once per shard, 1.1 s for 32 shards at 30 ms.
        with ThreadPoolExecutor(
            min(self.fetch_threads, len(files)),
            thread_name_prefix="trainingrun-shard-headers",
            initializer=give_way_to_training,
        ) as pool:
            return list(pool.map(shard, files))

    #: Whether a shard may start with an llm.c header.
    headers = True

    def _shard(self, uri: str, path: str, entry: dict[str, Any]) -> Shard:
        size = int(entry.get("size") or 0)
        version = str(
            next(
                (
                    entry[k]
                    for k in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified")
                    if entry.get(k) is not None
                ),
                "",
            )
        )
        if self.headers and size >= LLMC_HEADER_BYTES:
            header = np.frombuffer(self._fetch(path, uri, 0, LLMC_HEADER_BYTES), dtype="<i4")
            dtype = LLMC_MAGICS.get(int(header[0]))
            if dtype is not None:
                tokens, width = int(header[2]), np.dtype(dtype).itemsize
                expected = LLMC_HEADER_BYTES + tokens * width
                if size != expected:
                    raise DataError(
                        f"{uri}: its llm.c header says {tokens} {dtype} tokens ({expected} bytes), but the "
                        f"shard has {size} bytes: {'truncated' if size < expected else 'not an llm.c shard'}?"
                        " Write it again"
                    )
                return Shard(uri, path, size, version, LLMC_HEADER_BYTES, dtype, tokens)
        width = np.dtype(self.dtype).itemsize
        if size % width:
            raise DataError(
                f"{uri}: {size} bytes is not a whole number of {self.dtype} tokens ({width} bytes each): "
                "a truncated shard, or set dtype to the width it was written with"
            )
        return Shard(uri, path, size, version, 0, self.dtype, size // width)

    def _region(self, shard: Shard) -> tuple[int, int]:
        """(first token, number of windows) of this split in a shard."""
        eval_tokens = int(shard.tokens * self.eval_fraction)
        first, last = (
            (0, shard.tokens - eval_tokens) if self.split == "train" else (shard.tokens - eval_tokens, shard.tokens)
        )
        return first, max(0, last - first - self.context_length)

    # ------------------------------------------------------------ items

    def __len__(self) -> int:
        return self.num_samples

    def _item_range(self, index: int) -> tuple[Shard, int, int]:
        """(shard, first byte, end byte) of item `index`."""
        index = checked_index(index, self.num_samples)
        window = int(np.random.default_rng([self.seed, _WINDOW_TAG, self._split_id, index]).integers(self.windows))
        number = bisect.bisect_right(self._ends, window)
        shard, (first, _) = self.shards[number], self._regions[number]
        position = first + window - (self._ends[number - 1] if number else 0)
        width = np.dtype(shard.dtype).itemsize
        start = shard.offset + position * width
        return shard, start, start + (self.context_length + 1) * width

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Items read and converted together: the DataLoader asks for a batch's items in one call, and one
        conversion and one vocabulary check per batch cost the thread that reads ahead of the step less than
        one per item."""
        found = [self._ranges.pop(index, None) or self._item_range(index) for index in indices]  # type: ignore[arg-type]
        tokens = np.empty((len(found), self.context_length + 1), dtype=np.int64)
        for row, (shard, start, end) in zip(tokens, found):
            row[:] = np.frombuffer(self._read(shard, start, end), dtype=LITTLE_ENDIAN[shard.dtype])
        if self.vocab_size is not None and len(found) and int(tokens.max()) >= self.vocab_size:
            at, column = divmod(int(tokens.argmax()), tokens.shape[1])
            shard, start, _ = found[at]
            raise DataError(
                f"{shard.uri}: token {int(tokens.max())} at byte "
                f"{start + column * np.dtype(shard.dtype).itemsize} is not below vocab_size "
                f"{self.vocab_size}: the shard holds {shard.dtype} tokens of a larger vocabulary, or dtype "
                "is wrong"
            )
        return [{"tokens": window} for window in torch.from_numpy(tokens).unbind(0)]

    def missing(self, index: int) -> Optional[Callable[[], None]]:
        """None when item `index`'s blocks are in the node's cache, else the fetch that brings them there, for a
        background thread (sampling.read_ahead). Cheap when cached, so a warm cache costs the read-ahead no thread
        hand-off per item. The item's byte range is kept for its read."""
        shard, start, end = self._item_range(index)
        if len(self._ranges) > 4 * max(self.read_ahead, 1):
            self._ranges.clear()  # items fetched ahead but never read (an epoch's end): forget them
        self._ranges[index] = (shard, start, end)
        absent = []
        for block in range(start // self.block_bytes, (end - 1) // self.block_bytes + 1):
            if (shard.uri, block) not in self._in_cache:
                cached = self._cached(shard, block)
                if os.path.exists(cached):
                    self._in_cache.add((shard.uri, block))
                else:
                    absent.append((block, cached))
        if not absent:
            return None

        def fetch() -> None:
            for block, cached in absent:
                self._fetch_once(shard, block, cached)

        return fetch

    # ------------------------------------------------------------ reading

    def _read(self, shard: Shard, start: int, end: int) -> bytes:
        size = self.block_bytes
        piece = b"".join(
            self._block_part(
                shard, block, max(start, block * size) - block * size, min(end, (block + 1) * size) - block * size
            )
            for block in range(start // size, (end - 1) // size + 1)
        )
        if len(piece) != end - start:
            raise DataError(
                f"{shard.uri}: read {len(piece)} bytes at byte {start}, expected {end - start}: the shard "
                f"is shorter than the {shard.size} bytes it had when listed (replaced or truncated?)"
            )
        return piece

    def _cached(self, shard: Shard, block: int) -> str:
        key = self._cache_keys.get(shard.uri)
        if key is None:
            key = self._cache_keys[shard.uri] = hashlib.sha256(
                f"{shard.uri}\0{shard.size}\0{shard.version}\0{self.block_bytes}".encode()
            ).hexdigest()
        return os.path.join(self.cache, key[:2], f"{key}.{block}")

    def _block_part(self, shard: Shard, block: int, low: int, high: int) -> bytes:
        """Bytes [low, high) of a block: only those read from the node's cache, or the block fetched and cached."""
        cached = self._cached(shard, block)
        try:
            return read_part(cached, low, high)
        except FileNotFoundError:
            fetched = self._fetch_once(shard, block, cached)
        return read_part(cached, low, high) if fetched is None else fetched[low:high]

    def _fetch_once(self, shard: Shard, block: int, cached: str) -> Optional[bytes]:
        """The block when this thread fetched it; None when the fetch another thread had in flight cached it."""
        key = (shard.uri, block)
        self._in_this_process()
        with self._lock:
            in_flight = self._fetching.get(key)
            if in_flight is None:
                self._fetching[key] = threading.Event()
        if in_flight is not None:
            in_flight.wait()
            if os.path.exists(cached):
                return None
            return self._fetch_block(shard, block, cached)  # that fetch failed: this one reports why (or succeeds)
        try:
            return self._fetch_block(shard, block, cached)
        finally:
            with self._lock:
                self._fetching.pop(key).set()

    def _fetch_block(self, shard: Shard, block: int, cached: str) -> bytes:
        start = block * self.block_bytes
        data = self._fetch(shard.path, shard.uri, start, min(start + self.block_bytes, shard.size))
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        # Other workers and ranks of this node read the same cache: a block appears whole, or not at all.
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(cached), delete=False) as out:
            out.write(data)
        os.replace(out.name, cached)
        self._in_cache.add((shard.uri, block))
        return data

    def _fetch(self, path: str, uri: str, start: int, end: int) -> bytes:
        try:
            return self._filesystem().cat_file(path, start=start, end=end)
        except FileNotFoundError as error:
            raise DataError(f"{uri}: gone from storage since it was listed: {first_line(error)}") from error
        except Exception as error:  # unreachable, refused, timed out: a later attempt may succeed
            raise StorageUnavailable(f"cannot read {uri} bytes {start}-{end}: {first_line(error)}") from error
