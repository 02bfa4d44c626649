"""The checkpoint store on file:// (tmp_path): round trip, async staging, commit marker,
corruption fallback, rotation, model digest, storage failures, and a 2-process gloo run."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fsspec.implementations.local import LocalFileOpener
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint import (
    MANIFEST_NAME,
    CheckpointInfo,
    CheckpointStore,
    format_table,
    model_digest,
    to_json,
    verify,
)
from trainingrun_trainer.checkpoint.safe_load import _MetadataUnpickler
from trainingrun_trainer.checkpoint.storage import _Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def trained(seed: int = 0):
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    return model, opt


def app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def step_dir(root: Path, step: int) -> Path:
    return root / ckpt.step_dir_name(step)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def store(root):
    with CheckpointStore(f"file://{root}", keep=10) as s:
        yield s


def test_round_trip_model_optimizer_and_extra(store, root):
    model, opt = trained()
    extra = {"rng": torch.get_rng_state(), "sampler": {"epoch": 2, "index": 37}}
    digest = model_digest(model.state_dict())
    pending = store.save(10, app_state(model, opt), extra, config_hash="cfg123", model_digest=digest)
    info = pending.result()
    assert info == store.wait()
    assert info.valid and info.step == 10 and info.world_size == 1 and info.model_digest == digest
    assert info.uri == f"file://{root}/step-00000010"
    assert store.metrics.last_save_seconds > 0 and store.metrics.last_save_bytes == info.size_bytes > 0

    manifest = json.loads((step_dir(root, 10) / MANIFEST_NAME).read_text())
    on_disk = sorted(p.name for p in step_dir(root, 10).iterdir() if p.name != MANIFEST_NAME)
    # extra is this rank's entry of DCP's state dict: no file of its own
    assert [f["path"] for f in manifest["files"]] == on_disk == [".metadata", "__0_0.distcp"]
    assert manifest["config_hash"] == "cfg123" and manifest["step"] == 10 and manifest["format_version"] == 4

    fresh_model, fresh_opt = trained(seed=5)
    state = app_state(fresh_model, fresh_opt)
    latest = store.latest_valid()
    assert latest.step == 10 and latest.manifest_sha256 == info.manifest_sha256
    got_extra = store.load(latest, state)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_same(weights(fresh_model), weights(model))
    assert torch.equal(got_extra["rng"], extra["rng"]) and got_extra["sampler"] == extra["sampler"]
    assert store.metrics.last_restore_seconds > 0
    # The optimizer state came back too: the next step is identical.
    train_step(model, opt, seed=7)
    train_step(fresh_model, fresh_opt, seed=7)
    assert_same(weights(fresh_model), weights(model))
    assert verify(info.uri).valid


def test_async_save_stages_a_copy_before_returning(store, root, monkeypatch):
    """save() returns while the write is still pending; changing the live tensors afterwards
    does not change what gets written (staging copied them, CPU tensors included)."""
    entered, release = threading.Event(), threading.Event()
    real_save = dcp.save

    def gated_save(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", gated_save)
    model = make_model()
    before = weights(model)
    pending = store.save(1, {"model": model.state_dict()})
    assert entered.wait(30)
    assert not pending.done()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    release.set()
    info = store.wait()
    assert info.valid and pending.done()
    assert store.metrics.last_blocking_seconds < store.metrics.last_save_seconds

    loaded = make_model(seed=9)
    state = {"model": loaded.state_dict()}
    store.load(info, state)
    assert_same(weights(loaded), before)


def test_entries_copied_in_background_are_copied_while_save_has_returned(store, monkeypatch):
    """copy_in_background: save() returns before those entries are copied (the copy waits here on a gate that
    only opens after save() returned); wait_copied() waits for the copy, which holds the values at save() time,
    and counts as blocking; entries not named are copied before save() returns."""
    model, opt = trained()
    at_save, counts_at_save = weights(model), {"seen": 3}
    gate, stage = threading.Event(), store.committer.stage

    def gated_stage(plain):
        if "model" in plain:  # the background copy
            assert gate.wait(30), "the copy of the entries named in copy_in_background blocked save()"
        return stage(plain)

    monkeypatch.setattr(store.committer, "stage", gated_stage)
    counts = {"seen": 3}
    pending = store.save(4, {**app_state(model, opt), "counts": counts}, copy_in_background=("model", "optim"))
    counts["seen"] = 4  # not named: copied before save() returned
    blocked_in_save = store.metrics.last_blocking_seconds
    gate.set()
    waited = store.wait_copied()
    assert waited >= 0 and store.metrics.last_blocking_seconds == pytest.approx(blocked_in_save + waited)
    assert pending.blocking_seconds == store.metrics.last_blocking_seconds
    train_step(model, opt, seed=3)  # after wait_copied the weights may change
    info = store.wait()
    assert info.valid and store.wait_copied() == 0.0

    fresh_model, fresh_opt = trained(seed=5)
    state = {**app_state(fresh_model, fresh_opt), "counts": {"seen": 0}}
    store.load(info, state)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_same(weights(fresh_model), at_save)
    assert state["counts"] == counts_at_save


def test_a_failed_background_copy_is_raised_on_the_training_thread(store, monkeypatch):
    stage = store.committer.stage

    def failing_stage(plain):
        if "model" in plain:
            raise MemoryError("no room to copy")
        return stage(plain)

    monkeypatch.setattr(store.committer, "stage", failing_stage)
    store.save(1, {"model": make_model().state_dict()}, copy_in_background=("model",))
    with pytest.raises(MemoryError, match="no room to copy"):
        store.wait_copied()
    assert store.wait_copied() == 0.0  # raised once; the store takes the next save
    monkeypatch.setattr(store.committer, "stage", stage)
    with pytest.raises(MemoryError):
        store.wait()  # the failed save's handle says why
    assert store.save(2, {"model": make_model().state_dict()}).result().step == 2


def test_a_blocking_save_copies_everything_before_returning(store, monkeypatch):
    copied_on = []
    stage = store.committer.stage
    monkeypatch.setattr(
        store.committer, "stage", lambda plain: (copied_on.append(threading.current_thread()), stage(plain))[1]
    )
    store.save(1, {"model": make_model().state_dict()}, blocking=True, copy_in_background=("model",))
    assert copied_on == [threading.current_thread()]
    assert store.wait().valid


def test_a_later_save_finishes_the_previous_one(store):
    model = make_model()
    first = store.save(1, {"model": model.state_dict()})
    second = store.save(2, {"model": model.state_dict()})
    assert first.done()
    assert second.result().step == 2
    assert [i.step for i in store.list()] == [2, 1]


def test_manifest_is_written_last_and_a_dir_without_one_is_ignored(store, root, monkeypatch, caplog):
    model = make_model()
    store.save(1, {"model": model.state_dict()}, blocking=True)

    seen_when_committing = []
    real_write = _Storage.write_bytes

    def spy(self, uri, data, atomic=False):
        if uri.endswith(MANIFEST_NAME):
            directory = Path(uri[len("file://") :]).parent
            seen_when_committing.append(sorted(p.name for p in directory.iterdir()))
        return real_write(self, uri, data, atomic)

    monkeypatch.setattr(_Storage, "write_bytes", spy)
    assert store.save(2, {"model": model.state_dict()}, blocking=True).result().valid
    # Every other file was complete before the manifest was written.
    assert seen_when_committing == [[".metadata", "__0_0.distcp"]]

    # A process that dies before the commit leaves the data without a manifest.
    def crash_before_commit(self, uri, data, atomic=False):
        if uri.endswith(MANIFEST_NAME):
            raise OSError("killed before the commit")
        return real_write(self, uri, data, atomic)

    monkeypatch.setattr(_Storage, "write_bytes", crash_before_commit)
    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    assert store.save(3, {"model": model.state_dict()}).result() is None
    assert store.metrics.failed_saves == 1
    errors = [r for r in caplog.records if r.name == "trainingrun.checkpoint" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "killed before the commit" in errors[0].getMessage()
    monkeypatch.setattr(_Storage, "write_bytes", real_write)

    assert (step_dir(root, 3) / "__0_0.distcp").exists()
    assert not (step_dir(root, 3) / MANIFEST_NAME).exists()
    listed = {i.step: i for i in store.list()}
    assert not listed[3].valid and listed[3].reason == "no manifest (partial save)"
    assert listed[2].valid and listed[1].valid
    assert store.latest_valid().step == 2
    with pytest.raises(ValueError, match="no manifest"):
        store.load(listed[3].uri, {"model": make_model().state_dict()})


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


class RunsCode:
    """Unpickling this runs code: it creates the file at `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def rewrite_with_a_valid_manifest(directory: Path, name: str, content: bytes) -> None:
    """Someone who may write the bucket replaces a file and fixes the manifest to match."""
    import xxhash

    (directory / name).write_bytes(content)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["size"], entry["xxh3_128"] = len(content), xxhash.xxh3_128(content).hexdigest()
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name, refusal",
    [
        ("extra", "holds more than plain values"),
        (".metadata", "checkpoint metadata refers to 'pathlib'.'Path.touch'"),
        ("__0_0.distcp", "UnpicklingError: Weights only load failed"),
    ],
)
def test_nothing_read_from_storage_runs_code(store, root, tmp_path, name, refusal):
    """A rank's extra state, DCP's metadata or a non-tensor value in DCP's data (optimizer hyperparameters are
    stored that way) that would run code when unpickled: the load refuses, and nothing ran."""
    import io
    import pickle

    model, opt = trained()
    store.save(2, app_state(model, opt), {"step": 2})
    store.wait()
    marker = tmp_path / "code-ran"
    if name != ".metadata":
        state = app_state(model, opt)
        if name == "extra":  # the rank's entry: the bytes of a torch.save, loaded as plain values too
            buffer = io.BytesIO()
            torch.save({"step": 2, "payload": RunsCode(marker)}, buffer)
            state["extra-rank-0"] = buffer.getvalue()
        else:  # a dict of plain values in the optimizer state, replaced by the payload in DCP's own byte format
            state["optim"]["param_groups"][0]["lr"] = RunsCode(marker)
        payload = tmp_path / "payload"
        dcp.save(state, storage_writer=FsspecWriter(f"file://{payload}"), no_dist=True)  # as the store writes
        for copied in (".metadata", "__0_0.distcp"):
            rewrite_with_a_valid_manifest(step_dir(root, 2), copied, (payload / copied).read_bytes())
    else:
        buffer = io.BytesIO()
        pickle.dump(RunsCode(marker), buffer)
        rewrite_with_a_valid_manifest(step_dir(root, 2), name, buffer.getvalue())
    assert store.latest_valid().step == 2  # the manifest matches: only loading can tell
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointLoadError, match=refusal):
        store.load(store.latest_valid(), app_state(*trained(seed=5)))
    assert not marker.exists()


def test_metadata_may_name_dcp_enum_members_through_getattr_and_nothing_else():
    """Found on real pods: the trainer image's Python pickles DCP's enum members as getattr(EnumClass, name).
    That getattr is admitted for members of DCP's own enums only."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    class Reduced:
        def __init__(self, *target):
            self.target = target

        def __reduce__(self):
            return (getattr, self.target)

    def load(obj):
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()

    assert load([Reduced(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")]) == [
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    ]
    with pytest.raises(pickle.UnpicklingError, match="only members of DCP's own enums"):
        load(Reduced(Metadata, "__init__"))


def test_plain_values_survive_the_safe_loader(store):
    """What the built-in trainer keeps in extra: RNG states (numpy's is an array), scheduler, sampler."""
    import random

    import numpy as np

    from trainingrun_trainer.seeding import rng_state

    extra = {"rng": rng_state(), "sampler": {"epoch": 1}, "loss": 0.5, "run_uid": "u", "items": [1, (2, 3)]}
    store.save(1, {"model": make_model().state_dict()}, extra)
    store.wait()
    loaded = store.load(store.latest_valid(), {"model": make_model(3).state_dict()})
    assert loaded["rng"]["python"] == random.getstate() or loaded["rng"]["python"] == extra["rng"]["python"]
    assert np.array_equal(loaded["rng"]["numpy"][1], extra["rng"]["numpy"][1])
    assert {k: loaded[k] for k in ("sampler", "loss", "run_uid", "items")} == {
        k: extra[k] for k in ("sampler", "loss", "run_uid", "items")
    }


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


def test_state_may_not_use_the_extra_entries_names(store):
    with pytest.raises(ValueError, match="reserved for each rank's extra state"):
        store.save(1, {"model": make_model().state_dict(), "extra-rank-0": 1})
    with pytest.raises(ValueError, match="reserved for this rank's extra state"):
        store.load(store.save(1, {"model": make_model().state_dict()}, blocking=True).result(), {"extra-rank-0": b""})


def write_format_1(directory: Path, state: dict, extra: dict, step: int) -> None:
    """A checkpoint as trainer images before format 2 wrote it: extra in a file of its own."""
    import hashlib
    import io

    dcp.save(state, storage_writer=FsspecWriter(f"file://{directory}"), no_dist=True)
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    (directory / "extra-rank-0.pt").write_bytes(buffer.getvalue())
    files = [
        {"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(directory.iterdir())
    ]
    (directory / MANIFEST_NAME).write_text(
        json.dumps(
            {
                "format_version": 1,
                "step": step,
                "time": "2026-11-20T00:00:00Z",
                "world_size": 1,
                "config_hash": "",
                "model_digest": "",
                "torch_version": torch.__version__,
                "files": files,
            }
        )
    )


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


def test_rotation_keeps_newest_and_milestones(root):
    model = make_model()
    with CheckpointStore(str(root), keep=2, keep_every=3) as store:  # a plain path works too
        for step in range(1, 8):
            store.save(step, {"model": model.state_dict()})
        store.wait()
        assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000006", "step-00000007"]

        # Leftovers of failed saves: one older than the newest valid checkpoint (never usable:
        # deleted), one newer (maybe a save in progress: kept).
        for step in (4, 9):
            step_dir(root, step).mkdir()
            (step_dir(root, step) / "__0_0.distcp").write_bytes(b"partial")
        assert store.rotate() == [f"{root}/step-00000004"]
        assert sorted(p.name for p in root.iterdir()) == [
            "step-00000003",
            "step-00000006",
            "step-00000007",
            "step-00000009",
        ]

    # Another process sees the newest checkpoint corrupt: it is never counted, and rotation
    # never deletes the newest valid one (6) or anything newer.
    flip_byte(step_dir(root, 7) / "__0_0.distcp")
    with CheckpointStore(str(root), keep=1) as other:
        assert other.rotate() == [f"{root}/step-00000003"]
        assert other.latest_valid().step == 6
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006", "step-00000007", "step-00000009"]


def test_rotation_reads_each_older_checkpoint_once_not_at_every_save(root, monkeypatch):
    """Milestones accumulate: every save's rotation would otherwise read all of them again (a listing and a manifest
    each: round trips on an object store). One that leaves the listing is forgotten: read again if it comes back.
    (The `keep` newest are judged afresh at every rotation: test_partial_and_corrupt_checkpoints_fall_back.)"""
    from trainingrun_trainer.checkpoint import rotation

    shallow: list[str] = []
    inspect = rotation._inspect

    def counted(storage, uri, step, deep, **kwargs):
        if not deep:
            shallow.append(uri.rsplit("/", 1)[-1])
        return inspect(storage, uri, step, deep, **kwargs)

    monkeypatch.setattr(rotation, "_inspect", counted)
    model = make_model()
    with CheckpointStore(str(root), keep=1, keep_every=2) as store:
        for step in range(1, 10):
            store.save(step, {"model": model.state_dict()})
            store.wait()
        assert sorted(p.name for p in root.iterdir()) == [f"step-0000000{s}" for s in (2, 4, 6, 8, 9)]
        assert sorted(shallow) == sorted(set(shallow))  # none read twice (each was verified as the newest once)
        away = step_dir(root, 4).rename(root / "elsewhere")
        store.save(10, {"model": model.state_dict()})
        store.wait()
        away.rename(step_dir(root, 4))
        shallow.clear()
        store.save(11, {"model": model.state_dict()})
        store.wait()
    assert shallow == ["step-00000004"]  # back in the listing: read again; the others were not


@pytest.mark.filterwarnings("error:Detected an existing checkpoint")
def test_resaving_a_step_replaces_it(store, root):
    first, second = make_model(1), make_model(2)
    store.save(4, {"model": first.state_dict()})
    stale = step_dir(root, 4) / "__1_0.distcp"  # e.g. left by a run with more ranks
    store.wait()
    stale.write_bytes(b"old")
    info = store.save(4, {"model": second.state_dict()}).result()
    assert info.valid and not stale.exists()
    loaded = make_model(3)
    store.load(store.latest_valid(), {"model": loaded.state_dict()})
    assert_same(weights(loaded), weights(second))


def test_model_digest():
    a, b = make_model(0), make_model(0)
    assert model_digest(a.state_dict()) == model_digest(b.state_dict())
    # Wrapping (DDP's "module.", torch.compile's "_orig_mod.") does not change the digest.
    wrapped = {f"module._orig_mod.{k}": v for k, v in a.state_dict().items()}
    assert model_digest(wrapped) == model_digest(a.state_dict())
    with torch.no_grad():
        b[0].weight[0, 0] += 1e-6
    assert model_digest(a.state_dict()) != model_digest(b.state_dict())
    assert model_digest(a.state_dict()) != model_digest(a.to(torch.float64).state_dict())
    renamed = {k.replace("weight", "w"): v for k, v in make_model(0).state_dict().items()}
    assert model_digest(renamed) != model_digest(make_model(0).state_dict())


def test_storage_failure_is_logged_counted_and_recovered(store, root, monkeypatch, caplog):
    model = make_model()
    store.save(1, {"model": model.state_dict()})
    store.wait()

    real_write = LocalFileOpener.write

    def disk_full(self, *args, **kwargs):
        if "step-00000002" in self.path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(LocalFileOpener, "write", disk_full)
    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    pending = store.save(2, {"model": model.state_dict()})  # no exception here...
    assert pending.result() is None  # ...nor here
    assert store.wait() is None
    assert store.metrics.failed_saves == 1
    errors = [r for r in caplog.records if r.name == "trainingrun.checkpoint" and r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "rank 0: OSError: [Errno 28] No space left on device" in errors[0].getMessage()
    assert not (step_dir(root, 2) / MANIFEST_NAME).exists()

    # A blocking save fails the same way: no exception.
    assert store.save(2, {"model": model.state_dict()}, blocking=True).result() is None
    assert store.metrics.failed_saves == 2

    monkeypatch.setattr(LocalFileOpener, "write", real_write)  # storage is back
    assert store.save(3, {"model": model.state_dict()}).result().valid
    assert store.metrics.failed_saves == 2
    assert store.latest_valid().step == 3
    # The commit of step 3 rotated out the failed step-2 directory: it can never be resumed from.
    assert [(i.step, i.valid) for i in store.list()] == [(3, True), (1, True)]


def test_cli_helpers(store):
    model = make_model()
    store.save(5, {"model": model.state_dict()}, model_digest=model_digest(model.state_dict()))
    store.save(6, {"model": model.state_dict()})
    store.wait()
    os.remove(store.list()[0].uri[len("file://") :] + "/" + MANIFEST_NAME)
    infos = store.list()
    table = format_table(infos).splitlines()
    assert table[0].split() == ["STEP", "VALID", "TIME", "SIZE", "MODEL", "URI", "/", "REASON"]
    assert table[1].split()[:2] == ["6", "NO"] and "(no manifest (partial save))" in table[1]
    assert table[2].split()[:2] == ["5", "yes"] and infos[1].model_digest[:12] in table[2]
    valid = infos[1]
    for heading, value in (("VALID", "yes"), ("TIME", valid.time), ("MODEL", valid.model_digest[:12])):
        start = table[0].index(heading)  # each heading starts where its values start
        assert table[2][start : start + len(value)] == value, (heading, table)
    size = table[0].index("SIZE")
    assert table[2][size] != " " and table[2][size - 1] == " ", table
    data = json.loads(to_json(infos))
    assert [d["step"] for d in data] == [6, 5]
    for d, info in zip(data, infos):
        assert CheckpointInfo(**d) == info
        assert {"step", "valid", "model_digest", "uri", "time", "size_bytes", "reason"} <= d.keys()
    assert data[1]["time"].endswith("Z") and data[1]["size_bytes"] > 0


# ----------------------------------------------------------------------------- two processes


def _two_rank_worker(rank: int, world: int, init_file: str, uri: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ddp = DDP(make_model(0))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        train_step(ddp, opt, seed=100 + rank)  # different data per rank; DDP keeps replicas equal
        store = CheckpointStore(uri, keep=2)
        state = app_state(ddp, opt)
        digest = model_digest(state["model"])
        saved = store.save(5, state, {"rank": rank, "rng": torch.get_rng_state()}, model_digest=digest).result()

        fresh = DDP(make_model(1))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        train_step(fresh, fresh_opt, seed=3)
        fresh_state = app_state(fresh, fresh_opt)
        latest = store.latest_valid()
        extra = store.load(latest, fresh_state)
        set_state_dict(fresh, fresh_opt, model_state_dict=fresh_state["model"], optim_state_dict=fresh_state["optim"])
        # Rank 1's storage fails during the next save: neither rank raises, both count the
        # failure, no manifest appears, and the save after that commits again.
        real_write = LocalFileOpener.write

        def disk_full(self, *args, **kwargs):
            if "step-00000006" in self.path:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(self, *args, **kwargs)

        if rank == 1:
            LocalFileOpener.write = disk_full
        failed_info = store.save(6, app_state(ddp, opt)).result()
        LocalFileOpener.write = real_write
        recovered = store.save(7, app_state(ddp, opt)).result()
        result = {
            "failed_info": failed_info,
            "recovered_step": recovered.step if recovered else None,
            "digest": digest,
            "saved_step": saved.step if saved else None,
            "latest_step": latest.step,
            "world_size": latest.world_size,
            "extra_rank": extra["rank"],
            "loaded_digest": model_digest(fresh.module.state_dict()),
            "failed": store.metrics.failed_saves,
        }
        store.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_save_and_load_then_one_rank_loads(tmp_path):
    uri = f"file://{tmp_path / 'ckpt'}"
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "pg-store"), uri, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["saved_step"] == result["latest_step"] == 5 and result["world_size"] == 2
        assert result["extra_rank"] == rank
        assert result["failed_info"] is None and result["failed"] == 1 and result["recovered_step"] == 7
        assert result["loaded_digest"] == result["digest"] == results[0]["digest"]
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step-00000005").iterdir())
    assert MANIFEST_NAME in files and not [name for name in files if name.startswith("extra")]  # in DCP's files

    # World size 2 -> 1: a single process loads the DDP checkpoint into a plain model.
    with CheckpointStore(uri) as store:
        assert [(i.step, i.valid) for i in store.list()] == [(7, True), (5, True)]  # 6 rotated out
        assert store.latest_valid().step == 7
        info = store.list()[1]
        assert info.world_size == 2 and info.model_digest == results[0]["digest"]
        model = make_model(7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        state = app_state(model, opt)
        extra = store.load(info, state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert extra["rank"] == 0
        assert model_digest(model.state_dict()) == info.model_digest
