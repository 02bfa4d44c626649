"""checkpoint/storage.py: hashing a file in object storage with ranges fetched at once."""

from __future__ import annotations

import hashlib
import threading
import uuid

import pytest
import xxhash

from trainingrun_trainer.checkpoint import storage as storage_module
from trainingrun_trainer.checkpoint.storage import Storage

DATA = bytes(range(256)) * 40  # 10240 bytes


class Kept:
    """What a memory tier's copy would get."""

    def __init__(self):
        self.data = bytearray()

    def write(self, chunk):
        self.data += chunk


@pytest.fixture
def bucket(monkeypatch):
    monkeypatch.setattr(storage_module, "HASH_CHUNK_BYTES", 1000)  # 11 ranges
    monkeypatch.setattr(storage_module, "FETCH_AHEAD", 3)
    uri = f"memory://bucket-{uuid.uuid4().hex}/run"
    store = Storage(uri, {})
    assert not store.local
    store.fs.pipe_file(store._path(f"{uri}/file"), DATA)
    return store, f"{uri}/file"


@pytest.mark.parametrize(
    "name,expected", [("xxh3_128", xxhash.xxh3_128(DATA).hexdigest()), ("sha256", hashlib.sha256(DATA).hexdigest())]
)
def test_ranges_are_hashed_and_copied_in_order(bucket, name, expected):
    store, uri = bucket
    kept = Kept()
    assert store.digest(uri, name, kept, size=len(DATA)) == (len(DATA), expected)
    assert bytes(kept.data) == DATA


def test_several_ranges_are_in_flight_at_once(bucket, monkeypatch):
    store, uri = bucket
    together = threading.Barrier(storage_module.FETCH_AHEAD, timeout=30)  # broken unless 3 wait at the same time
    real = store.fs.cat_file
    calls = []

    def cat_file(path, start=None, end=None, **kwargs):
        calls.append(start)
        if len(calls) <= storage_module.FETCH_AHEAD:
            together.wait()
        return real(path, start=start, end=end, **kwargs)

    monkeypatch.setattr(store.fs, "cat_file", cat_file)
    assert store.digest(uri, "sha256", size=len(DATA)) == (len(DATA), hashlib.sha256(DATA).hexdigest())
    assert not together.broken


@pytest.mark.parametrize("listed", [len(DATA) + 5, len(DATA) - 5, 0])
def test_a_file_of_another_size_than_listed_reads_as_that_size(bucket, listed):
    store, uri = bucket
    size, digest = store.digest(uri, "sha256", size=listed)
    assert size != listed or digest != hashlib.sha256(DATA[:listed]).hexdigest()
    assert size == (len(DATA) if listed > len(DATA) else listed + 1)


def test_a_local_file_is_read_as_one_stream(tmp_path):
    (tmp_path / "file").write_bytes(DATA)
    store = Storage(tmp_path.as_uri(), {})
    assert store.local
    assert store.digest((tmp_path / "file").as_uri(), "sha256", size=len(DATA)) == (
        len(DATA),
        hashlib.sha256(DATA).hexdigest(),
    )


def test_the_copy_is_written_beside_the_reading_at_most_copy_ahead_chunks_behind(bucket, monkeypatch):
    """A copy into memory took longer than reading and hashing the same bytes: its own thread writes it while the next
    chunks are read and hashed, and no more than COPY_AHEAD of them wait for it (each is 8 MiB)."""
    store, uri = bucket
    hashed, hashed_bytes = threading.Semaphore(0), [0]
    real_hasher = storage_module.file_hasher

    class Counting:
        def __init__(self, name):
            self.inner = real_hasher(name)

        def update(self, chunk):
            self.inner.update(chunk)
            hashed_bytes[0] += len(chunk)
            hashed.release()

        def hexdigest(self):
            return self.inner.hexdigest()

    class Slow(Kept):
        def __init__(self):
            super().__init__()
            self.behind = []

        def write(self, chunk):
            if not self.data:  # the first chunk's write waits until the second chunk is hashed without it
                assert hashed.acquire(timeout=10) and hashed.acquire(timeout=10)
            super().write(chunk)
            self.behind.append(hashed_bytes[0] - len(self.data))

    monkeypatch.setattr(storage_module, "file_hasher", Counting)
    kept = Slow()
    assert store.digest(uri, "xxh3_128", kept, size=len(DATA)) == (len(DATA), xxhash.xxh3_128(DATA).hexdigest())
    assert bytes(kept.data) == DATA
    assert max(kept.behind) <= (storage_module.COPY_AHEAD + 1) * 1000  # bytes hashed, not yet written
