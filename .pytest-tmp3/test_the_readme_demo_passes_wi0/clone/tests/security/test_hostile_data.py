"""What anyone who can write the data bucket can put in a shard: tar headers that would walk in place or make the
trainer hold a shard's worth of header, and images whose few kilobytes decode to gigabytes. Each must fail as a
DataError naming the shard and the member, at once, and never hang or starve a data worker."""

from __future__ import annotations

import io
import struct
import tarfile
import zlib

import pytest

from trainingrun_trainer.shards import ImageShards
from trainingrun_trainer.shards.format import MAX_EXTENDED_HEADER_BYTES, DataError, Shard, tar_samples
from trainingrun_trainer.shards.images import default_max_pixels


def shard_of(raw: bytes) -> tuple[Shard, object]:
    """A shard holding `raw`, and a reader over it that fails the test once it has read 1,000 blocks (a walk in
    place would read forever)."""
    shard = Shard(
        uri="s3://data/shard-0.tar",
        path="shard-0.tar",
        size=len(raw),
        version="1",
        offset=0,
        dtype="uint8",
        tokens=len(raw),
    )
    reads = [0]

    def read(low, high):
        reads[0] += 1
        assert reads[0] < 1000, f"read {reads[0]} times: the walk does not move on"
        return raw[low:high]

    return shard, read


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A GNU tar header whose size field says `size` (base-256 for negative sizes, as tar's format allows)."""
    info = tarfile.TarInfo(name)
    info.type = kind
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="strict")[:512])
    block[124:136] = tarfile.itn(size, 12, tarfile.GNU_FORMAT)
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


def test_a_member_with_a_negative_size_is_a_data_error_not_a_walk_in_place():
    """On main: `-512` moved the walk back onto the same header, forever, at full CPU."""
    raw = header("a.png", -512) + bytes(512) * 4
    assert tarfile.TarInfo.frombuf(raw[:512], "utf-8", "strict").size == -512
    shard, read = shard_of(raw)
    with pytest.raises(DataError, match=r"shard-0\.tar: member 'a\.png' at byte 0 says it has -512 bytes"):
        tar_samples(shard, read)


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME], ids=["pax", "long-name"])
def test_an_extended_header_longer_than_a_name_needs_is_not_read(kind):
    """On main the whole header was read into memory, bounded only by the shard's size."""
    size = MAX_EXTENDED_HEADER_BYTES + 1
    raw = header("././@LongLink", size, kind) + bytes(-(-size // 512) * 512) + bytes(1024)
    shard, read = shard_of(raw)
    asked = []
    with pytest.raises(DataError, match=r"shard-0\.tar: the (pax|long-name) header at byte 0 says \d+ bytes"):
        tar_samples(shard, lambda low, high: asked.append(high - low) or read(low, high))
    assert max(asked) == 512  # the header block, never its body


def test_a_long_name_within_bounds_still_names_its_member():
    name = "x" * 300 + ".png"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    shard, read = shard_of(buffer.getvalue())
    assert tar_samples(shard, read) == [("x" * 300, {"png": (1536, 3)})]


def png_header(width: int, height: int) -> bytes:
    """A PNG that says width x height (grayscale) and holds one small, broken IDAT: what a bomb looks like before it
    is decoded, in a few dozen bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")


def shards_with(tmp_path, images: dict[str, bytes], **options) -> ImageShards:
    folder = tmp_path / "wds"
    folder.mkdir(exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in [*images.items(), *((f"zz-held-out-{n}", c) for n, c in images.items())]:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    (folder / "shard-00000.tar").write_bytes(buffer.getvalue())
    return ImageShards(f"file://{folder}", eval_fraction=0.5, cache_dir=str(tmp_path / "cache"), **options)


@pytest.mark.parametrize(
    "side",
    [12_000, 20_000],  # 144 Mpx: decoded in full on main (1.5 GB a sample); 400 Mpx: Pillow's own error escaped
)
def test_an_image_bomb_is_refused_before_it_is_decoded_as_a_data_error(tmp_path, side):
    data = shards_with(tmp_path, {"bomb.png": png_header(side, side)}, image_size=32)
    with pytest.raises(DataError, match=r"shard-00000\.tar: member bomb\.png has more pixels than maxPixels"):
        data[0]


def test_max_pixels_follows_the_image_size_and_is_a_knob(tmp_path):
    from PIL import Image

    assert default_max_pixels(32) == 4096 * 4096 and default_max_pixels(512) == 1024 * 512 * 512
    photo = io.BytesIO()
    Image.new("RGB", (100, 80), (200, 10, 10)).save(photo, format="PNG")
    images = {"photo.png": photo.getvalue()}
    assert shards_with(tmp_path, images, image_size=8)[0]["images"].shape == (3, 8, 8)
    with pytest.raises(DataError, match=r"member photo\.png has more pixels than maxPixels \(64\).*\(100x80\)"):
        shards_with(tmp_path, images, image_size=8, max_pixels=64)[0]
    with pytest.raises(ValueError, match="max_pixels must be an integer of at least image_size squared"):
        shards_with(tmp_path, images, image_size=8, max_pixels=63)


@pytest.mark.parametrize(
    "content",
    [
        png_header(16, 16)[:-20],  # a PNG cut short
        b"\xff\xd8\xff\xe0" + bytes(40),  # a JPEG's marker and nothing of one
        b"GIF89a" + bytes(40),  # a format that is not decoded from shards
    ],
    ids=["truncated-png", "jpeg-marker-only", "gif"],
)
def test_every_decoder_error_is_a_data_error_naming_shard_and_member(tmp_path, content):
    data = shards_with(tmp_path, {"broken.png": content})
    with pytest.raises(DataError, match=r"shard-00000\.tar: member broken\.png"):
        data[0]


@pytest.mark.parametrize("kind, name", [("text", "notes.txt"), ("images", "cat.png")])
def test_data_prepare_packs_no_file_a_link_leads_to_outside_src(tmp_path, capsys, kind, name):
    """Issue 77 item 7: on main a link below SRC named like data (here to a credentials file) had its target packed
    into the shards `trainingrun data prepare` uploads. Links out of SRC are skipped and counted; a link to a file
    inside SRC is still read."""
    from trainingrun_operator import cli

    secret = tmp_path / "credentials"
    secret.write_bytes(b"aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET\n")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    own = src / ("a.txt" if kind == "text" else "a.png")
    own.write_bytes(b"kept sample bytes\n")
    (src / name).symlink_to(secret)
    (src / "sub" / ("b.txt" if kind == "text" else "b.png")).symlink_to(own)  # inside SRC: read
    (src / "outside").symlink_to(tmp_path, target_is_directory=True)  # a linked folder: never walked
    dest = tmp_path / "shards"
    assert cli.main(["data", "prepare", str(src), f"file://{dest}", "--kind", kind]) == 0
    output = capsys.readouterr()
    packed = b"".join(p.read_bytes() for p in sorted(dest.iterdir()))
    assert b"wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET" not in packed
    assert packed.count(b"kept sample bytes") == 2
    assert "skipped 1 link(s)" in output.err and "2 files" in output.out
