"""rotation.Rotation: keeps the newest valid checkpoints and the milestones, and reads each older checkpoint once
rather than at every save."""

from __future__ import annotations

import pytest
from checkpoint_states import (
    flip_byte,
    make_model,
    root,  # noqa: F401 - fixtures
    step_dir,
)

from trainingrun_trainer.checkpoint import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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
    inspect = rotation.inspect_step

    def counted(storage, uri, step, deep, **kwargs):
        if not deep:
            shallow.append(uri.rsplit("/", 1)[-1])
        return inspect(storage, uri, step, deep, **kwargs)

    monkeypatch.setattr(rotation, "inspect_step", counted)
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
