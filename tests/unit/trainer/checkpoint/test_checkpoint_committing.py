"""committing: a checkpoint is committed by its manifest, written last: a directory without one is never resumed
from."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from checkpoint_states import make_model, root, step_dir, store  # noqa: F401 - fixtures

from trainingrun_trainer.checkpoint import MANIFEST_NAME
from trainingrun_trainer.checkpoint.storage import Storage


def test_manifest_is_written_last_and_a_dir_without_one_is_ignored(store, root, monkeypatch, caplog):
    model = make_model()
    store.save(1, {"model": model.state_dict()}, blocking=True)

    seen_when_committing = []
    real_write = Storage.write_bytes

    def spy(self, uri, data, atomic=False):
        if uri.endswith(MANIFEST_NAME):
            directory = Path(uri[len("file://") :]).parent
            seen_when_committing.append(sorted(p.name for p in directory.iterdir()))
        return real_write(self, uri, data, atomic)

    monkeypatch.setattr(Storage, "write_bytes", spy)
    assert store.save(2, {"model": model.state_dict()}, blocking=True).result().valid
    # Every other file was complete before the manifest was written.
    assert seen_when_committing == [[".metadata", "__0_0.distcp"]]

    # A process that dies before the commit leaves the data without a manifest.
    def crash_before_commit(self, uri, data, atomic=False):
        if uri.endswith(MANIFEST_NAME):
            raise OSError("killed before the commit")
        return real_write(self, uri, data, atomic)

    monkeypatch.setattr(Storage, "write_bytes", crash_before_commit)
    caplog.set_level(logging.INFO, logger="trainingrun.checkpoint")
    assert store.save(3, {"model": model.state_dict()}).result() is None
    assert store.metrics.failed_saves == 1
    errors = [r for r in caplog.records if r.name == "trainingrun.checkpoint" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "killed before the commit" in errors[0].getMessage()
    monkeypatch.setattr(Storage, "write_bytes", real_write)

    assert (step_dir(root, 3) / "__0_0.distcp").exists()
    assert not (step_dir(root, 3) / MANIFEST_NAME).exists()
    listed = {i.step: i for i in store.list()}
    assert not listed[3].valid and listed[3].reason == "no manifest (partial save)"
    assert listed[2].valid and listed[1].valid
    assert store.latest_valid().step == 2
    with pytest.raises(ValueError, match="no manifest"):
        store.load(listed[3].uri, {"model": make_model().state_dict()})
