"""WebDataset tar shards of images (`ImageShards`), for the built-in masked autoencoder."""

from __future__ import annotations

import bisect
import warnings
from typing import Optional

import numpy as np
import torch

from trainingrun_api import builtin_args

from ..data import checked_index
from .format import DataError, Shard, first_line, tar_samples
from .tokens import TokenShards

#: The formats Pillow may decode from a shard: the IMAGE_EXTENSIONS', no others (each decoder is attack surface).
DECODED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM")
#: Images of up to this many times the output's pixels are decoded by default, and never fewer than MIN_MAX_PIXELS.
MAX_PIXELS_PER_OUTPUT_PIXEL = 1024
MIN_MAX_PIXELS = 4096 * 4096


def default_max_pixels(image_size: int) -> int:
    """The largest image decoded for an output of image_size x image_size: 1024 times its pixels, at least 16.7 Mpx
    (4096 x 4096; a 12 Mpx photo passes for any size). Pillow's own limit (89 Mpx warns, 179 Mpx refuses) is for any
    image anywhere; this one knows what the image is for."""
    return max(MIN_MAX_PIXELS, MAX_PIXELS_PER_OUTPUT_PIXEL * image_size * image_size)


class ImageShards(TokenShards):
    """WebDataset tar shards of images: `{"images": FloatTensor[channels, image_size, image_size]}` in [-1, 1].

    Args: `uri`, `pattern` (default "*.tar"), `image_size` (each image is centre-cropped to a square and resized),
    `channels` (3: RGB, 1: grayscale), and TokenShards' `eval_fraction` (the last part of each shard's samples),
    `cache_dir`, `block_bytes`, `endpoint_url`, `read_ahead`, `fetch_threads`. Every sample of a split is served
    once per epoch, in the sampler's order. A sample without an image member is an error that names it.
    """

    IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm")
    headers = False

    def __init__(
        self,
        uri: str,
        image_size: int = 32,
        channels: int = 3,
        pattern: str = "*.tar",
        eval_fraction: float = 0.05,
        split: str = "train",
        cache_dir: Optional[str] = None,
        block_bytes: int = 1 << 20,
        endpoint_url: Optional[str] = None,
        read_ahead: int = 512,
        fetch_threads: int = 16,
        max_pixels: Optional[int] = None,
    ):
        builtin_args.require(
            "trainingrun_trainer.shards.ImageShards", uri=uri, image_size=image_size, channels=channels,
            pattern=pattern, eval_fraction=eval_fraction, split=split, cache_dir=cache_dir, block_bytes=block_bytes,
            endpoint_url=endpoint_url, read_ahead=read_ahead, fetch_threads=fetch_threads, max_pixels=max_pixels,
        )  # fmt: skip
        self.max_pixels = default_max_pixels(image_size) if max_pixels is None else max_pixels
        self.image_size, self.channels = image_size, channels
        super().__init__(
            uri,
            context_length=1,
            dtype="uint8",
            pattern=pattern,
            num_samples=None,
            eval_fraction=eval_fraction,
            seed=0,
            split=split,
            cache_dir=cache_dir,
            block_bytes=block_bytes,
            endpoint_url=endpoint_url,
            read_ahead=read_ahead,
            fetch_threads=fetch_threads,
        )

    def _nothing_in_split(self) -> str:
        return (
            f"{self.uri}: no image samples in the {self.split} split of {len(self.shards)} shards "
            f"({self.eval_fraction:g} of each shard's samples are eval): check the shards hold <key>.<ext> members"
        )

    def _samples_per_epoch(self) -> int:
        return self.windows  # every sample of the split once

    def _region(self, shard: Shard) -> tuple[int, int]:
        """(first sample, samples) of this split in a shard."""
        samples = len(self._members(shard))
        eval_samples = int(samples * self.eval_fraction)
        return (0, samples - eval_samples) if self.split == "train" else (samples - eval_samples, eval_samples)

    def _members(self, shard: Shard) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        """[(key, {extension: (offset, size)})] of a shard, from its tar headers (read once, then kept)."""
        cache: Optional[dict[str, list[tuple[str, dict[str, tuple[int, int]]]]]] = getattr(self, "_member_cache", None)
        if cache is None:
            cache = {}
            self._member_cache = cache
        if shard.uri not in cache:
            cache[shard.uri] = tar_samples(shard, lambda start, end: self._read(shard, start, end))
        return cache[shard.uri]

    def _image_member(self, index: int) -> tuple[Shard, str, int, int]:
        """(shard, member name, first byte, end byte) of sample `index`'s image."""
        index = checked_index(index, self.num_samples)
        number = bisect.bisect_right(self._ends, index)
        shard, (first, _) = self.shards[number], self._regions[number]
        key, members = self._members(shard)[first + index - (self._ends[number - 1] if number else 0)]
        found = next(((ext, members[ext]) for ext in self.IMAGE_EXTENSIONS if ext in members), None)
        if found is None:
            raise DataError(
                f"{shard.uri}: sample {key!r} has no image member (it has {', '.join(sorted(members))}); "
                f"expected one of .{', .'.join(self.IMAGE_EXTENSIONS)}"
            )
        ext, (offset, size) = found
        return shard, f"{key}.{ext}", offset, offset + size

    def _item_range(self, index: int) -> tuple[Shard, int, int]:
        shard, _, start, end = self._image_member(index)
        return shard, start, end

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, member, start, end = self._image_member(index)
        return {"images": self._decode(shard, member, self._read(shard, start, end))}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[index] for index in indices]  # decoding dominates: nothing to share across a batch

    def _decode(self, shard: Shard, member: str, raw: bytes) -> torch.Tensor:
        import io

        from PIL import Image

        too_large = (
            f"{shard.uri}: member {member} has more pixels than maxPixels ({self.max_pixels}) allows for imageSize "
            f"{self.image_size}"
        )
        fix = ": shrink the image, or raise spec.trainer.data.dataset.initArgs.maxPixels"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below says it
                opened = Image.open(io.BytesIO(raw), formats=DECODED_FORMATS)  # the header only
            with opened:
                width, height = opened.size
                if width * height > self.max_pixels:
                    raise DataError(f"{too_large} ({width}x{height}){fix}")
                image = opened.convert("RGB" if self.channels == 3 else "L")
                side = min(image.size)
                left, top = (image.width - side) // 2, (image.height - side) // 2
                image = image.crop((left, top, left + side, top + side)).resize(
                    (self.image_size, self.image_size), Image.Resampling.BILINEAR
                )
                pixels = np.asarray(image, dtype=np.float32)
        except DataError:
            raise
        except Image.DecompressionBombError as error:  # Pillow's own bound, past twice its MAX_IMAGE_PIXELS
            raise DataError(f"{too_large}: {first_line(error)}{fix}") from None
        except Exception as error:  # noqa: BLE001 - decoders raise what they like (SyntaxError, struct.error...)
            raise DataError(
                f"{shard.uri}: member {member} is not an image Pillow can read: {first_line(error)}"
            ) from None
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return torch.from_numpy(pixels.transpose(2, 0, 1) / 127.5 - 1.0)
