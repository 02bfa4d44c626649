"""shards.format.tar_samples: the walk over a WebDataset tar's headers finds each sample's members by key (ustar,
GNU long names, pax paths), and a tar that is truncated, damaged or hostile is a DataError naming the byte, never a
loop or a huge read."""

from __future__ import annotations

import io
import tarfile

import pytest

from trainingrun_trainer.shards.format import MAX_EXTENDED_HEADER_BYTES, DataError, Shard, tar_samples


def tar_of(members: dict[str, bytes], tar_format=tarfile.GNU_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tar_format) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def walk(data: bytes, reads: list | None = None):
    shard = Shard(uri="file:///s.tar", path="s.tar", size=len(data), version="1", offset=0, dtype="uint8", tokens=0)

    def read(low, high):
        if reads is not None:
            reads.append(high - low)
        return data[low:high]

    return tar_samples(shard, read)


def test_members_are_grouped_by_key_in_order_with_their_byte_ranges():
    data = tar_of(
        {"a/0001.jpg": b"J" * 700, "a/0001.CLS": b"3", "a/0002.jpg": b"K", "README": b"x", ".hidden.txt": b"h"}
    )
    samples = walk(data)
    assert [key for key, _ in samples] == ["a/0001", "a/0002"]  # a name without an extension is no sample's
    members = dict(samples)["a/0001"]
    assert set(members) == {"jpg", "cls"}
    start, size = members["jpg"]
    assert data[start : start + size] == b"J" * 700


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_names_longer_than_ustars_hundred_characters_are_read_from_the_extended_header(tar_format):
    name = "d" * 150 + "/sample.png"
    assert [key for key, _ in walk(tar_of({name: b"p"}, tar_format))] == ["d" * 150 + "/sample"]


def test_a_tar_without_its_end_marker_is_named_truncated():
    data = tar_of({"x.txt": b"1"})
    with pytest.raises(DataError, match="without tar's end-of-archive marker: truncated"):
        walk(data[:1024])


def test_a_member_past_the_end_is_named():
    data = bytearray(tar_of({"x.bin": b"1" * 10}))
    header = tarfile.TarInfo("x.bin")
    header.size = 10**6
    data[:512] = header.tobuf(tarfile.GNU_FORMAT)[:512]
    with pytest.raises(DataError, match=r"member x.bin at byte 0 says 1000000 bytes, past the shard's end"):
        walk(bytes(data))


def test_a_negative_size_is_refused_rather_than_read_again_forever():
    data = bytearray(tar_of({"x.bin": b"1"}))
    data[124:136] = b"\xff" * 12  # base-256: a negative number
    data[148:156] = b" " * 8
    data[148:155] = f"{sum(data[:512]):06o}\0".encode()
    with pytest.raises(DataError, match="says it has -1 bytes: a damaged or hostile tar"):
        walk(bytes(data))


def test_an_extended_header_longer_than_any_name_is_not_read():
    data = tar_of({"p" * 80 + "/" + "q" * (MAX_EXTENDED_HEADER_BYTES + 10) + ".txt": b"1"}, tarfile.PAX_FORMAT)
    reads: list = []
    with pytest.raises(DataError, match="the pax header at byte 0 says .* more than the 65536"):
        walk(data, reads)
    assert max(reads) == 512


def test_garbage_is_no_tar_header():
    with pytest.raises(DataError, match="no tar header at byte 0"):
        walk(b"not a tar" * 200)
