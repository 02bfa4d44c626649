"""Datasets in object storage (gs://, s3://, file:// or a path, through fsspec): token shards and plain text.

Shard layouts, as nanoGPT and llm.c users already have them:

- nanoGPT: a `.bin` file of little-endian tokens (`dtype` uint16, or uint32 for vocabularies over 65,536), no header.
- llm.c: a 1024-byte header of 256 int32 (magic 20240520 with uint16 tokens, or 20240801 with uint32; a version; the
  token count), then the tokens. Found by its magic, whatever `dtype` says.
- `TextBytes`: any text file read as bytes, a vocabulary of 256 (the built-in character model with `vocabSize: 256`).
- `ImageShards`: WebDataset's layout, tar files whose members `<key>.<ext>` group into samples by key; each sample's
  image (jpg, png, webp...) is decoded with Pillow, for the built-in masked autoencoder.

Item i of a split is a window of `context_length + 1` tokens at a position drawn from
`numpy.random.default_rng([seed, tag, split, i])`: a pure function of (seed, split, index), as the generated datasets
are, so the `ResumableSampler`'s position resumes exactly at any world size. Positions are uniform over every window
of every shard; a window never spans two shards. The last `eval_fraction` of each shard's tokens is the eval split.

`ImageShards` serves sample i of a split directly (the sampler shuffles): its members' offsets come from reading
the tar headers once, through the same cache, and are kept beside it.

Only the bytes of a window are read, in blocks of `block_bytes` fetched by byte range and kept in a local cache
directory shared by the ranks and DataLoader workers of a node: never a whole shard up front. A cached block is
named after the shard's URI, size and version (ETag or mtime), so a shard replaced in storage is read again.
"""

from .format import LLMC_HEADER_BYTES, DataError
from .images import ImageShards
from .text import TextBytes
from .tokens import TokenShards

__all__ = ["TokenShards", "TextBytes", "ImageShards", "DataError", "LLMC_HEADER_BYTES"]
