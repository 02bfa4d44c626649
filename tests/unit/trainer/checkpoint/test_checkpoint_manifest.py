"""manifest.parse_manifest: a manifest read from storage is taken only in the shape this trainer writes (a bounded
object, a known format, each file a plain name of its directory listed once with a size and a digest of its format's
kind, short ASCII strings); anything else is a reason that names what is wrong, and the checkpoint is not valid."""

from __future__ import annotations

import json

import pytest

from trainingrun_trainer.checkpoint.manifest import MAX_MANIFEST_BYTES, parse_manifest

DIGEST = "0" * 32


def manifest(**changes) -> bytes:
    body = {
        "format_version": 4,
        "step": 10,
        "world_size": 2,
        "time": "2026-12-01T10:00:00.000000Z",
        "files": [
            {"path": ".metadata", "size": 10, "xxh3_128": DIGEST},
            {"path": "__0_0.distcp", "size": 0, "xxh3_128": DIGEST},
        ],
        **changes,
    }
    return json.dumps(body).encode()


def test_a_manifest_this_trainer_writes_is_taken():
    parsed = parse_manifest(manifest())
    assert parsed["step"] == 10 and [f["path"] for f in parsed["files"]] == [".metadata", "__0_0.distcp"]
    sha = parse_manifest(manifest(format_version=3, files=[{"path": "a", "size": 1, "sha256": "a" * 64}]))
    assert sha["format_version"] == 3


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"[]", "not a JSON object"),
        (
            manifest(format_version=9),
            "format_version 9, expected one of 1, 2, 3, 4 (written by a newer trainer image?)",
        ),
        (manifest(format_version=True), "format_version True"),
        (manifest(files={"path": "a"}), "'files' is not a list of {path, size, xxh3_128}"),
        (manifest(files=[{"path": "a", "size": -1, "xxh3_128": DIGEST}]), "'files' is not a list"),
        (manifest(files=[{"path": "a", "size": True, "xxh3_128": DIGEST}]), "'files' is not a list"),
        (manifest(files=[{"path": "a", "size": 1, "xxh3_128": "A" * 32}]), "'files' is not a list"),
        (manifest(files=[{"path": "a", "size": 1, "sha256": "a" * 64}]), "'files' is not a list"),  # not format 4's
        (manifest(files=[{"path": "../../etc/passwd", "size": 1, "xxh3_128": DIGEST}]), "not a plain file name"),
        (manifest(files=[{"path": "sub/a", "size": 1, "xxh3_128": DIGEST}]), "not a plain file name"),
        (manifest(files=[{"path": "manifest.json", "size": 1, "xxh3_128": DIGEST}]), "not a plain file name"),
        (manifest(files=[{"path": "a", "size": 1, "xxh3_128": DIGEST}] * 2), "it lists a file twice"),
        (manifest(step=-1), "'step' is not a non-negative integer"),
        (manifest(step="10"), "'step' is not a non-negative integer"),
        (manifest(run_uid="é"), "'run_uid' is not a short ASCII string"),
        (manifest(model_digest="x" * 257), "'model_digest' is not a short ASCII string"),
        (manifest(world_size=0), "'world_size' is not a positive integer"),
    ],
)
def test_anything_else_names_what_is_wrong(raw, reason):
    with pytest.raises(ValueError) as raised:
        parse_manifest(raw)
    assert reason in str(raised.value)


def test_a_manifest_past_the_size_cap_is_not_parsed():
    with pytest.raises(ValueError, match="larger than 64 MiB"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1))


def test_a_pods_partial_copy_is_valid_shallow_but_a_file_of_another_size_or_a_deep_check_is_not(tmp_path):
    """`inspect_step(partial=True)`: a pod's memory copy of a sharded state on more than two pods lacks the files its ranks
    do not read; every file it does hold still has its listed size, and a deep check needs them all."""
    from trainingrun_trainer.checkpoint.manifest import inspect_step
    from trainingrun_trainer.checkpoint.storage import Storage

    directory = tmp_path / "step-00000010"
    directory.mkdir()
    (directory / "manifest.json").write_bytes(manifest())
    (directory / ".metadata").write_bytes(b"m" * 10)  # __0_0.distcp is not held here
    storage = Storage(str(directory), {})
    assert inspect_step(storage, str(directory), 10, deep=False).reason == "missing file __0_0.distcp"
    held = inspect_step(storage, str(directory), 10, deep=False, partial=True)
    assert held.valid and held.files == {".metadata": 10, "__0_0.distcp": 0}
    assert not inspect_step(storage, str(directory), 10, deep=True, partial=True).valid
    (directory / ".metadata").write_bytes(b"m" * 9)
    assert inspect_step(storage, str(directory), 10, deep=False, partial=True).reason == "size mismatch in .metadata"
