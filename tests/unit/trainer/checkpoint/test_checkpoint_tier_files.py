"""tier_files.VerifiedTierFile: a tier file reads its bytes and checks every segment a read touches, whole; a damaged
segment or a file cut short fails the read."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainingrun_trainer.checkpoint import (
    tier_files,
)


def tier_file(path: Path, data: bytes, segment_bytes: int = 16) -> tier_files.TierFile:
    """`data` written at `path` as the tier writes a copy, with its recorded digests."""
    path.write_bytes(data)
    hasher = tier_files.SegmentHasher()
    hasher.update(data)
    return tier_files.TierFile(str(path), len(data), segment_bytes, tuple(hasher.finish()))


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(tier_files, "SEGMENT_BYTES", 16)
    monkeypatch.setattr(tier_files, "READ_CHUNK", 5)  # reads cross chunk and segment boundaries


def read_at(stream, offset: int, length: int) -> bytes:
    buffer = bytearray(length)
    stream.seek(offset)
    assert stream.readinto(buffer) == length
    return bytes(buffer)


def test_a_tier_file_reads_its_bytes_and_checks_every_segment_it_touches(tmp_path, small_segments):
    data = bytes(range(100))
    kept = tier_file(tmp_path / "f", data)
    assert len(kept.digests) == 7  # 6 whole segments and 4 bytes
    with tier_files.VerifiedTierFile(kept) as stream:
        assert read_at(stream, 0, 100) == data
        assert read_at(stream, 37, 20) == data[37:57]  # backwards, into segments already checked
        stream.finish()
    with tier_files.VerifiedTierFile(kept) as stream:
        assert read_at(stream, 90, 10) == data[90:] and stream.read() == b""
        assert read_at(stream, 20, 3) == data[20:23]  # the rest of segment 1 is read when it is left or finished
        stream.finish()


@pytest.mark.parametrize(
    "damaged_at, read, fails",
    [
        (20, (20, 3), True),  # in the bytes read
        (17, (20, 3), True),  # in the same segment, before them
        (30, (20, 3), True),  # in the same segment, after them: checked by finish()
        (40, (20, 3), False),  # in a segment never read: this reader does not need it
        (99, (0, 100), True),  # the last, short segment
    ],
)
def test_a_damaged_segment_that_a_read_touches_fails_it(tmp_path, small_segments, damaged_at, read, fails):
    data = bytearray(range(100))
    kept = tier_file(tmp_path / "f", bytes(data))
    data[damaged_at] ^= 0xFF
    (tmp_path / "f").write_bytes(bytes(data))
    with tier_files.VerifiedTierFile(kept) as stream:
        if not fails:
            read_at(stream, *read)
            stream.finish()
            return
        with pytest.raises(tier_files.TierMismatch, match=r"bytes \d+-\d+ differ from what was written there"):
            read_at(stream, *read)
            stream.finish()


def test_a_tier_file_cut_short_fails_the_read(tmp_path, small_segments):
    kept = tier_file(tmp_path / "f", bytes(100))
    (tmp_path / "f").write_bytes(bytes(50))
    with (
        tier_files.VerifiedTierFile(kept) as stream,
        pytest.raises(tier_files.TierMismatch, match="ends at 50 bytes"),
    ):
        read_at(stream, 40, 30)


class Storage:
    """DCP's reader FileSystem, as LocalFirstFileSystem wraps it: streams of the files below a folder."""

    def __init__(self, root: Path):
        self.root = root

    def create_stream(self, path, mode):
        return open(self.root / Path(path).name, mode)


@pytest.mark.parametrize("verified", [True, False])
def test_a_file_the_tier_lacks_is_read_from_storage_only_once_storage_is_verified(tmp_path, small_segments, verified):
    """A checkpoint the pods' memory holds has its files in storage only listed: reading one this pod lacks would take
    bytes nothing checked, so it fails as a damaged copy does (and is read again once rank 0 verified storage)."""
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "__2_0.distcp").write_bytes(b"theirs")
    held = tier_file(tmp_path / "__1_0.distcp", b"mine")
    reading = tier_files.LocalFirstFileSystem({"__1_0.distcp": held}, storage_verified=verified)
    reading.inner = Storage(tmp_path / "storage")
    with reading.create_stream("step/__1_0.distcp", "rb") as stream:
        assert stream.read() == b"mine"
    if verified:
        with reading.create_stream("step/__2_0.distcp", "rb") as stream:
            assert stream.read() == b"theirs"
        assert reading.sources == {"memory", "storage"} and not reading.mismatched
    else:
        with pytest.raises(tier_files.TierMismatch, match="__2_0.distcp is not in this pod's memory"):
            with reading.create_stream("step/__2_0.distcp", "rb"):
                pass
        assert reading.mismatched == {"__2_0.distcp"} and reading.sources == {"memory"}
