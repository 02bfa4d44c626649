"""checkpoint.hashing_fs: every file DCP writes is hashed on its way (its manifest entry) and copied into the memory
tier, whatever the size of the writes; reads pass through; a failed write records nothing and leaves no copy."""

import array
import os
from contextlib import contextmanager

import pytest
import xxhash

from trainingrun_trainer.checkpoint import hashing_fs
from trainingrun_trainer.checkpoint.layout import FILE_DIGEST
from trainingrun_trainer.checkpoint.memory_tier import MemoryTier


class LocalFiles:
    """The two calls of DCP's FileSystem that the wrapper intercepts, on local files."""

    @contextmanager
    def create_stream(self, path, mode):
        with open(path, mode) as stream:
            yield stream

    def rename(self, path, new_path):
        os.rename(path, new_path)

    def exists(self, path):  # anything else goes to the inner filesystem
        return os.path.exists(path)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(hashing_fs, "PIECE_BYTES", 1000)  # the hashing thread starts within a small file


@pytest.mark.parametrize("write_sizes", [[10], [999, 1], [1000], [2500, 3, 1997], [7000]])
def test_a_file_written_in_any_pieces_has_the_size_and_digest_of_its_bytes(tmp_path, small_pieces, write_sizes):
    record: dict = {}
    files = hashing_fs.HashingFileSystem(LocalFiles(), record, None, None)
    data = os.urandom(sum(write_sizes))
    with files.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        offset = 0
        for size in write_sizes:
            assert stream.write(data[offset : offset + size]) == size
            offset += size
    assert (tmp_path / "__0_0.distcp").read_bytes() == data
    assert record == {"__0_0.distcp": {"size": len(data), FILE_DIGEST: xxhash.xxh3_128(data).hexdigest()}}


def test_writes_of_typed_buffers_count_bytes_not_items(tmp_path):
    record: dict = {}
    files = hashing_fs.HashingFileSystem(LocalFiles(), record, None, None)
    numbers = array.array("i", range(100))
    with files.create_stream(tmp_path / "f", "wb") as stream:
        assert stream.write(numbers) == numbers.itemsize * 100
    assert record["f"]["size"] == numbers.itemsize * 100 == (tmp_path / "f").stat().st_size


def test_the_memory_tier_gets_a_copy_and_follows_the_rename_of_the_metadata(tmp_path):
    tier_dir = tmp_path / "tier" / "step-00000001"
    tier_dir.mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    record: dict = {}
    files = hashing_fs.HashingFileSystem(LocalFiles(), record, MemoryTier(str(tmp_path / "tier")), str(tier_dir))
    with files.create_stream(out / ".metadata.tmp", "wb") as stream:
        stream.write(b"metadata bytes")
    files.rename(out / ".metadata.tmp", out / ".metadata")
    assert list(record) == [".metadata"] and (out / ".metadata").read_bytes() == b"metadata bytes"
    assert (tier_dir / ".metadata").read_bytes() == b"metadata bytes"
    assert not (tier_dir / ".metadata.tmp").exists()
    assert files.exists(out / ".metadata")  # passed on


def test_a_failed_write_records_nothing_and_keeps_no_copy(tmp_path):
    tier_dir = tmp_path / "tier" / "step-00000001"
    tier_dir.mkdir(parents=True)
    record: dict = {}
    files = hashing_fs.HashingFileSystem(LocalFiles(), record, MemoryTier(str(tmp_path / "tier")), str(tier_dir))
    with pytest.raises(OSError, match="bucket went away"):
        with files.create_stream(tmp_path / "data", "wb") as stream:
            stream.write(b"half")
            raise OSError("bucket went away")
    assert record == {}
    assert sorted(p.name for p in tier_dir.iterdir()) == []


def test_reading_passes_through_unhashed(tmp_path):
    (tmp_path / "f").write_bytes(b"stored")
    record: dict = {}
    files = hashing_fs.HashingFileSystem(LocalFiles(), record, None, None)
    with files.create_stream(tmp_path / "f", "rb") as stream:
        assert stream.read() == b"stored"
    assert record == {}
