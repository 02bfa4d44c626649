"""shards.images.ImageShards: each sample of a split served once, decoded and resized; a damaged shard named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainingrun_trainer.shards import DataError, ImageShards


def write_images(folder, count, size=(48, 40)):
    """PNG images whose red channel is the image's number (which sample came back is visible in its pixels), blue
    255, and green noise (so each file is a few kB, as photos are larger than a tar block)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for number in range(count):
        pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
        pixels[:, :, 0], pixels[:, :, 2] = number * 10, 255
        pixels[:, :, 1] = rng.integers(0, 256, size=(size[1], size[0]))
        Image.fromarray(pixels).save(folder / f"img-{number:03d}.png")


def test_image_shards_serve_each_sample_of_a_split_once_decoded_and_resized(tmp_path):
    from trainingrun_trainer.prepare import prepare

    write_images(tmp_path / "photos", 20)
    done = prepare(tmp_path / "photos", f"file://{tmp_path}/wds", "images", shard_bytes=30 * 1024)
    assert len(done.shards) >= 2 and all(uri.endswith(".tar") for uri in done.shards)
    train = ImageShards(f"file://{tmp_path}/wds", image_size=8, eval_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    evaluation = ImageShards(
        f"file://{tmp_path}/wds", image_size=8, eval_fraction=0.2, split="eval", cache_dir=str(tmp_path / "cache")
    )
    reds = sorted(round((float(train[i]["images"][0, 0, 0]) + 1) * 127.5) for i in range(len(train)))
    held_out = sorted(round((float(evaluation[i]["images"][0, 0, 0]) + 1) * 127.5) for i in range(len(evaluation)))
    assert sorted(reds + held_out) == [n * 10 for n in range(20)]  # every image once, in one split only
    image = train[0]["images"]
    assert (
        image.shape == (3, 8, 8)
        and image.dtype == torch.float32
        and -1 <= float(image.min()) <= float(image.max()) <= 1
    )
    assert abs(float(image[2, 0, 0]) - 1.0) < 1e-6  # blue 255 -> 1.0


def test_a_damaged_image_shard_is_named(tmp_path):
    import io
    import tarfile

    from trainingrun_trainer.prepare import prepare

    write_images(tmp_path / "photos", 6)
    prepare(tmp_path / "photos", f"file://{tmp_path}/wds", "images")
    shard = tmp_path / "wds" / "shard-00000.tar"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:700])  # cut inside the first member
    with pytest.raises(
        DataError,
        match=r"shard-00000\.tar: member 00000000\.png at byte 0 says \d+ bytes, past the "
        r"shard's end \(700 bytes\): truncated",
    ):
        ImageShards(f"file://{tmp_path}/wds", cache_dir=str(tmp_path / "cache-1"))
    first_member_end = 512 + -(-tarfile.TarInfo.frombuf(whole[:512], "utf-8", "strict").size // 512) * 512
    shard.write_bytes(whole[:first_member_end])  # cut between members: every header fits, the end marker is gone
    with pytest.raises(
        DataError,
        match=rf"shard-00000\.tar: ends at byte {first_member_end} without tar's "
        "end-of-archive marker: truncated",
    ):
        ImageShards(f"file://{tmp_path}/wds", cache_dir=str(tmp_path / "cache-1b"))
    shard.write_bytes(b"not a tar at all" * 64)
    with pytest.raises(DataError, match=r"shard-00000\.tar: no tar header at byte 0"):
        ImageShards(f"file://{tmp_path}/wds", cache_dir=str(tmp_path / "cache-2"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in (("a.png", b"this is not a png"), ("b.txt", b"caption only")):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    shard.write_bytes(buffer.getvalue())
    data = ImageShards(f"file://{tmp_path}/wds", eval_fraction=0.5, cache_dir=str(tmp_path / "cache-3"))
    with pytest.raises(DataError, match=r"member a\.png is not an image Pillow can read"):
        data[0]
    with pytest.raises(DataError, match=r"sample 'b' has no image member \(it has txt\)"):
        ImageShards(f"file://{tmp_path}/wds", eval_fraction=0.5, split="eval", cache_dir=str(tmp_path / "cache-3"))[0]
