"""Plain text files as token shards of bytes (`TextBytes`)."""

from __future__ import annotations

from typing import Optional

from trainingrun_api import builtin_args

from .tokens import TokenShards


class TextBytes(TokenShards):
    """Plain text files as bytes (a vocabulary of 256): `{"tokens": LongTensor[context_length + 1]}`.

    TokenShards' arguments but `dtype` (bytes are the tokens), with `pattern` "*.txt"."""

    def __init__(
        self,
        uri: str,
        context_length: int = 64,
        pattern: str = "*.txt",
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
            "trainingrun_trainer.shards.TextBytes", uri=uri, context_length=context_length, pattern=pattern,
            num_samples=num_samples, eval_fraction=eval_fraction, seed=seed, split=split, cache_dir=cache_dir,
            block_bytes=block_bytes, endpoint_url=endpoint_url, read_ahead=read_ahead, fetch_threads=fetch_threads,
        )  # fmt: skip
        super().__init__(
            uri,
            context_length=context_length,
            dtype="uint8",
            pattern=pattern,
            num_samples=num_samples,
            eval_fraction=eval_fraction,
            seed=seed,
            split=split,
            cache_dir=cache_dir,
            block_bytes=block_bytes,
            endpoint_url=endpoint_url,
            read_ahead=read_ahead,
            fetch_threads=fetch_threads,
        )

    headers = False
