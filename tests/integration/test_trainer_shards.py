"""The built-in trainer on data in object storage: token shards and text on the GCS emulator and on moto's S3,
a worker SIGKILLed mid-epoch, and the resumed run ends with the model of an uninterrupted run that read the same
bytes from local files (tests/unit/trainer/shards/ covers the formats, the errors and the cache)."""

from __future__ import annotations

import numpy as np
import pytest
from test_trainer_resume import final_digest, killed_at, stderr_of, torchrun

from storage_servers import gcs_bucket, gcs_move_is_copy, gcs_server, s3_bucket, s3_server  # noqa: F401
from tiny_runs import tiny_model, tiny_trainer
from trainingrun_trainer.data import SyntheticText

pytestmark = pytest.mark.slow


def token_shards() -> dict[str, bytes]:
    """Two nanoGPT shards (uint16, no header) of a learnable sequence: the synthetic text's Markov chain."""
    text = SyntheticText(num_samples=400, context_length=63, vocab_size=128, seed=3)
    tokens = np.concatenate([text[i]["tokens"].numpy() for i in range(len(text))]).astype("<u2")
    half = len(tokens) // 2
    return {"train_000.bin": tokens[:half].tobytes(), "train_001.bin": tokens[half:].tobytes()}


def text_files() -> dict[str, bytes]:
    rng = np.random.default_rng(4)
    words = ["checkpoint", "resume", "gradient", "the", "of", "a", "run", "pod", "step", "loss"]
    return {f"part-{n}.txt": " ".join(rng.choice(words, size=3000)).encode() for n in range(2)}


def image_shards() -> dict[str, bytes]:
    """WebDataset tar shards of 64 small noisy images, as `trainingrun data prepare --kind images` writes them."""
    import tempfile
    from pathlib import Path

    from PIL import Image

    from trainingrun_trainer.prepare import prepare

    rng = np.random.default_rng(5)
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(64):
            Image.fromarray(rng.integers(0, 256, size=(12, 12, 3), dtype=np.uint8)).save(f"{scratch}/{number:03d}.png")
        prepare(Path(scratch), f"file://{scratch}/out", "images", shard_bytes=16 * 1024)
        return {p.name: p.read_bytes() for p in sorted(Path(scratch, "out").iterdir())}


CHAR_MODEL = {**tiny_model(), "initArgs": {**tiny_model()["initArgs"]}}
MAE_MODEL = {
    "classPath": "trainingrun_trainer.models.MaskedAutoencoder",
    "initArgs": {"imageSize": 8, "patchSize": 4, "dim": 16, "layers": 1, "heads": 2, "decoderDim": 8},
}
# kind: (dataset class, its files, its initArgs, the model and its vocabulary)
DATASETS = {
    "tokens": (
        "trainingrun_trainer.shards.TokenShards",
        token_shards,
        {"vocabSize": 128, "contextLength": 16, "numSamples": 2000},
        CHAR_MODEL,
        128,
    ),
    "text": (
        "trainingrun_trainer.shards.TextBytes",
        text_files,
        {"contextLength": 16, "numSamples": 2000},
        CHAR_MODEL,
        256,
    ),
    "images": ("trainingrun_trainer.shards.ImageShards", image_shards, {"imageSize": 8}, MAE_MODEL, None),
}


@pytest.fixture(params=["gs", "s3"])
def bucket(request):
    """(server, bucket URI, environment and initArgs a trainer needs to read it)."""
    if request.param == "gs":  # gcsfs finds the emulator as any GCS client would (see test_trainer_faults.py)
        server, uri = request.getfixturevalue("gcs_server"), request.getfixturevalue("gcs_bucket")
        return server, uri, {"STORAGE_EMULATOR_HOST": server.endpoint_url, "NO_GCE_CHECK": "true"}, {}
    server, uri = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    return (
        server,
        uri,
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        {"endpointUrl": server.endpoint_url},
    )


@pytest.fixture(scope="module")
def uninterrupted_digests() -> dict[str, str]:
    """Kind of data -> the model digest at step 40 of the uninterrupted run that read it from local files: the same
    for either bucket, so each kind's run is run once a module (the files are seeded, so alike each time)."""
    return {}


@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_killed_mid_epoch_and_resumed_from_the_bucket_as_if_uninterrupted(
    bucket, kind, tmp_path, tmp_path_factory, uninterrupted_digests
):
    server, uri, env, reach = bucket
    class_path, files, args, model, vocabulary = DATASETS[kind]
    for name, content in files().items():
        server.fs.pipe_file(f"{uri}/data/{name}".split("://", 1)[1], content)

    def trainer(data_uri: str, **more: str) -> dict:
        built = {**model, "initArgs": {**model["initArgs"], **({"vocabSize": vocabulary} if vocabulary else {})}}
        dataset = {"classPath": class_path, "initArgs": {"uri": data_uri, **args, **more}}
        return tiny_trainer(
            maxSteps=40,
            deterministic=True,
            logIntervalSteps=1,
            model=built,
            data={"dataset": dataset, "batchSize": 8, "numWorkers": 1},
        )

    if kind not in uninterrupted_digests:
        root = tmp_path_factory.mktemp(f"reference-{kind}")
        local = root / "local-copy"
        local.mkdir()
        for name, content in files().items():
            (local / name).write_bytes(content)
        reference = torchrun(
            root, "reference", trainer=trainer(f"file://{local}"), env={"TRAININGRUN_DATA_CACHE": str(root / "cache")}
        )
        err = stderr_of(reference)
        assert reference.returncode == 0, err[-3000:]
        uninterrupted_digests[kind] = final_digest(root, "reference", 40)

    from_bucket = trainer(f"{uri}/data", **reach)
    # Each run its own block cache: the resumed run reads the bucket again, not what the first one cached.
    killed_at(
        tmp_path,
        "interrupted",
        15,
        trainer=from_bucket,
        env={**env, "TRAININGRUN_DATA_CACHE": str(tmp_path / "cache-1")},
    )
    resumed = torchrun(
        tmp_path, "interrupted", trainer=from_bucket, env={**env, "TRAININGRUN_DATA_CACHE": str(tmp_path / "cache-2")}
    )
    err = stderr_of(resumed)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in err and "at step 10" in err
    assert any((tmp_path / "cache-2").rglob("*.*"))  # blocks were fetched from the bucket and cached
    assert final_digest(tmp_path, "interrupted", 40) == uninterrupted_digests[kind]


def test_prepare_uploads_text_shards_that_the_dataset_reads(bucket, tmp_path, monkeypatch):
    """`trainingrun data prepare` to the bucket, then TextBytes over what it wrote."""
    from trainingrun_trainer.prepare import prepare_text
    from trainingrun_trainer.shards import TextBytes

    server, uri, env, reach = bucket
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, content in text_files().items():
        (corpus / name).write_bytes(content)
    done = prepare_text(corpus, f"{uri}/prepared", shard_bytes=5000, endpoint_url=reach.get("endpointUrl"))
    text = b"\n".join(p.read_bytes() for p in sorted(corpus.glob("*.txt")))
    assert len(done.shards) == -(-len(text) // 5000)
    assert b"".join(server.fs.cat_file(s.split("://", 1)[1]) for s in done.shards) == text
    data = TextBytes(
        f"{uri}/prepared", context_length=32, cache_dir=str(tmp_path / "cache"), endpoint_url=reach.get("endpointUrl")
    )
    assert [s.uri for s in data.shards] == done.shards
    assert all(bytes(data[i]["tokens"].tolist()) in text for i in range(30))
