"""restoring: latest_valid skips a damaged checkpoint for the one before, a rank the checkpoint did not have gets no
extra, and checkpoints of older formats (1, 3 with sha256) still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import assert_same, flip_byte, make_model, root, step_dir, store, weights, write_sha256_manifest  # noqa: F401 - fixtures
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore, verify


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: flip_byte(d / "__0_0.distcp"), "xxh3_128 mismatch in __0_0.distcp"),
        (lambda d: flip_byte(d / ".metadata"), "xxh3_128 mismatch in .metadata"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-10]),
            "size mismatch in __0_0.distcp",
        ),
        (lambda d: (d / "__0_0.distcp").unlink(), "missing file __0_0.distcp"),
        (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "manifest unreadable"),
    ],
    ids=["flipped-byte", "flipped-metadata-byte", "truncated", "missing", "bad-manifest"],
)
def test_damaged_checkpoint_is_skipped_and_older_one_used(store, root, damage, reason):
    old, new = make_model(1), make_model(2)
    store.save(1, {"model": old.state_dict()})
    store.save(2, {"model": new.state_dict()})
    store.wait()
    damage(step_dir(root, 2))

    listed = store.list()
    assert [(i.step, i.valid) for i in listed] == [(2, False), (1, True)]
    assert listed[0].reason.startswith(reason)
    assert verify(listed[0].uri).reason.startswith(reason)
    latest = store.latest_valid()  # the same store wrote step 2: it is re-hashed all the same
    assert latest.step == 1
    loaded = make_model(3)
    store.load(latest, {"model": loaded.state_dict()})
    assert_same(weights(loaded), weights(old))


def test_a_rank_the_checkpoint_did_not_have_gets_no_extra(store, caplog):
    """A world that grew: rank 1 loads a checkpoint saved by one rank. Its entry is missing; the rest loads."""
    model = make_model(1)
    store.save(1, {"model": model.state_dict()}, {"rank": 0}, blocking=True)
    store.context.ranks.rank = (
        1  # as the store of rank 1 would be; the entry lookup is the same code with or without peers
    )
    loaded = make_model(2)
    assert store.load(store.latest_valid(), {"model": loaded.state_dict()}) == {}
    assert_same(weights(loaded), weights(model))
    assert "no extra state for rank 1 (saved by fewer ranks)" in caplog.text


def write_format_1(directory: Path, state: dict, extra: dict, step: int) -> None:
    """A checkpoint as trainer images before format 2 wrote it: extra in a file of its own."""
    import io

    dcp.save(state, storage_writer=FsspecWriter(f"file://{directory}"), no_dist=True)
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    (directory / "extra-rank-0.pt").write_bytes(buffer.getvalue())
    write_sha256_manifest(directory, 1, step)


def test_a_format_1_checkpoint_still_loads(store, root):
    """Checkpoints written before an upgrade resume: DCP holds the model, extra comes from its own file, and
    entries the old format kept in extra are left as they were."""
    model = make_model(1)
    write_format_1(step_dir(root, 4), {"model": model.state_dict()}, {"step": 4, "sampler": {"epoch": 1}}, step=4)
    info = store.latest_valid()
    assert info.step == 4 and info.valid and info.format_version == 1
    loaded, kept = make_model(2), {"epoch": 0}
    extra = store.load(info, {"model": loaded.state_dict(), "sampler": kept})
    assert extra == {"step": 4, "sampler": {"epoch": 1}} and kept == {"epoch": 0}
    assert_same(weights(loaded), weights(model))
    # a format the reader does not know is not a checkpoint it can resume from
    manifest = json.loads((step_dir(root, 4) / MANIFEST_NAME).read_text())
    (step_dir(root, 4) / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 5}))
    assert "format_version 5, expected one of 1, 2, 3, 4" in store.list()[0].reason


def as_format_3(directory: Path) -> None:
    """Rewrite a checkpoint's manifest as trainer images before format 4 wrote it: the same files, each with a sha256."""
    import hashlib

    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((directory / entry["path"]).read_bytes()).hexdigest()
    (directory / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 3}))


def test_a_format_3_checkpoint_with_sha256_digests_is_verified_by_them_and_loads(store, root):
    model = make_model(1)
    store.save(4, {"model": model.state_dict()}, {"step": 4})
    assert store.wait() is not None
    as_format_3(step_dir(root, 4))
    fresh = CheckpointStore(str(root))
    info = fresh.latest_valid()
    assert info.step == 4 and info.valid and info.format_version == 3
    loaded = make_model(2)
    assert fresh.load(info, {"model": loaded.state_dict()}) == {"step": 4}
    assert_same(weights(loaded), weights(model))
    flip_byte(step_dir(root, 4) / "__0_0.distcp")
    assert CheckpointStore(str(root)).list()[0].reason == "sha256 mismatch in __0_0.distcp"
