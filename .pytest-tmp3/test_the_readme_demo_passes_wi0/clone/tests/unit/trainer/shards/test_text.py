"""shards.text.TextBytes: a text file is read as its bytes, windows of consecutive bytes."""

from __future__ import annotations

import pytest

from trainingrun_trainer.shards import TextBytes


def test_text_is_read_as_bytes(tmp_path):
    (tmp_path / "text").mkdir()
    text = ("The quick brown fox jumps over the lazy dog. " * 40).encode()
    (tmp_path / "text" / "fox.txt").write_bytes(text)
    (tmp_path / "text" / "notes.md").write_bytes(b"\xff" * 100)  # not *.txt: not read
    data = TextBytes(f"file://{tmp_path / 'text'}", context_length=20, cache_dir=str(tmp_path / "cache"))
    window = bytes(data[5]["tokens"].tolist())
    assert len(window) == 21 and window in text
    with pytest.raises(TypeError, match="dtype"):  # bytes are the tokens
        TextBytes(f"file://{tmp_path / 'text'}", dtype="uint16")
