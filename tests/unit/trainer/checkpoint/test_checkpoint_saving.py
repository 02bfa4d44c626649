"""saving.Saver: a save returns once the state is staged (or copied, for a blocking one), entries copied in the
background are the live tensors' at save time, their failure reaches the training thread, and a later save finishes
the one before."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import app_state, assert_same, make_model, root, store, train_step, trained, weights  # noqa: F401 - fixtures
from torch.distributed.checkpoint.state_dict import set_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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


def _peer_gone_worker(rank: int, init_file: str, uri: str, tiers: list, out_dir: str) -> None:
    import json
    import os
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from trainingrun_trainer.checkpoint import CheckpointStore, PeersLost

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    model = make_model()
    with CheckpointStore(uri, memory_tier=tiers[rank], persist_behind=True) as store:
        if rank == 1:  # gone without a word, as a pod on a failed node: its sockets close with it
            os._exit(0)
        store.save(5, {"model": model.state_dict()}, {"rank": rank})
        try:
            store.wait_committed()
            outcome = "committed"
        except PeersLost as error:
            outcome = f"{type(error).__name__}: {error} / {type(error.__cause__).__name__}"
        Path(out_dir, "rank0.json").write_text(json.dumps({"outcome": outcome, "failed": store.metrics.failed_saves}))
        os._exit(0)  # the process group cannot be torn down without its peer


@pytest.mark.slow
def test_waiting_for_a_commit_a_peer_left_raises_peers_lost(tmp_path):
    """A save whose collectives fail because the other rank is gone: `wait_committed` raises `PeersLost` (main
    retries the attempt, as for any collective a dead peer broke), with the collective's error as its cause."""
    import json

    import torch.multiprocessing as mp

    tiers = [str(tmp_path / f"node-{rank}" / "tier") for rank in range(2)]
    mp.spawn(
        _peer_gone_worker,
        args=(str(tmp_path / "pg"), f"file://{tmp_path / 'ckpt'}", tiers, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["outcome"].startswith("PeersLost: checkpoint step 5 could not commit:"), result
    assert result["failed"] == 1
