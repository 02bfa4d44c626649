"""`trainingrun data prepare`: text files into TextBytes shards (file:// here; gs:// and s3:// in
tests/integration/test_trainer_shards.py)."""

from __future__ import annotations

import pytest

from trainingrun_operator import cli
from trainingrun_trainer.prepare import PrepareError, prepare_text
from trainingrun_trainer.shards import TextBytes


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"first file " * 50)
    (folder / "b" / "big.txt").write_bytes(bytes(range(32, 127)) * 40)  # larger than a shard
    (folder / "c.txt").write_bytes(b"last")
    (folder / "notes.md").write_bytes(b"not text for training")
    return folder


def joined(folder):
    return b"\n".join(p.read_bytes() for p in sorted(folder.rglob("*.txt")))


def test_text_is_joined_into_shards_of_the_size_asked_and_read_back(source, tmp_path):
    seen = []
    done = prepare_text(source, f"file://{tmp_path}/out", shard_bytes=1000, progress=lambda d, t: seen.append((d, t)))
    text = joined(source)
    assert done.files == 3 and done.bytes == len(text)
    assert len(done.shards) == -(-len(text) // 1000) and done.shards[0] == f"file://{tmp_path}/out/shard-00000.txt"
    shards = sorted((tmp_path / "out").iterdir())
    assert [p.stat().st_size for p in shards[:-1]] == [1000] * (len(shards) - 1)
    assert b"".join(p.read_bytes() for p in shards) == text  # every byte once, in order; notes.md left out
    assert seen[-1] == (len(text), len(text)) and all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    data = TextBytes(f"file://{tmp_path}/out", context_length=32, cache_dir=str(tmp_path / "cache"))
    assert all(bytes(data[i]["tokens"].tolist()) in text for i in range(20))


def test_a_destination_with_shards_is_kept_unless_overwrite(source, tmp_path):
    destination = f"file://{tmp_path}/out"
    first = prepare_text(source, destination, shard_bytes=500)
    with pytest.raises(PrepareError, match=f"DEST {destination} already holds {len(first.shards)} shards.*--overwrite"):
        prepare_text(source, destination, shard_bytes=2000)
    again = prepare_text(source, destination, shard_bytes=2000, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"shard-{n:05d}.txt" for n in range(len(again.shards))
    ]
    assert b"".join(p.read_bytes() for p in sorted((tmp_path / "out").iterdir())) == joined(source)


def test_a_source_without_text_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="has no .txt files"):
        prepare_text(tmp_path / "empty", f"file://{tmp_path}/out")
    with pytest.raises(PrepareError, match="is not a directory"):
        prepare_text(tmp_path / "missing", f"file://{tmp_path}/out")


def test_the_command(source, tmp_path, capsys):
    assert cli.main(["data", "prepare", str(source), f"file://{tmp_path}/out", "--shard-mb", "0.001"]) == 0
    out, err = capsys.readouterr()
    assert "3 files" in out and "shards under" in out and "TextBytes" in out
    assert "(100%)" in err.splitlines()[-1]  # plain progress lines when not a terminal
    assert cli.main(["data", "prepare", str(source), f"file://{tmp_path}/out"]) == 1
    assert "already holds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["data", "prepare", str(source), "out", "--shard-mb", "-1"])
