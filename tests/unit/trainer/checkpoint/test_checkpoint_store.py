"""The checkpoint store as a whole on file:// (tmp_path): round trip, commit marker, corruption fallback, older
formats, re-saving a step, storage failures, and a 2-process gloo run. Its parts alone: test_checkpoint_<part>.py."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_states import app_state, assert_same, make_model, root, step_dir, store, train_step, trained, weights  # noqa: F401 - fixtures
from fsspec.implementations.local import LocalFileOpener
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore, model_digest, verify

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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


def test_state_may_not_use_the_extra_entries_names(store):
    with pytest.raises(ValueError, match="reserved for each rank's extra state"):
        store.save(1, {"model": make_model().state_dict(), "extra-rank-0": 1})
    with pytest.raises(ValueError, match="reserved for this rank's extra state"):
        store.load(store.save(1, {"model": make_model().state_dict()}, blocking=True).result(), {"extra-rank-0": b""})


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


@pytest.mark.slow
def test_scripts_save_path_follows_a_save_onto_the_checkpoint_thread():
    """scripts/save_path.py, the reader's map of one save: it sees the modules the background thread runs too (the
    writer and the manifest's check come after the training thread returned)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("save_path", Path(__file__).parents[4] / "scripts" / "save_path.py")
    assert spec is not None and spec.loader is not None
    save_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(save_path)
    path = save_path.save_path(persist_behind=False)
    assert path[0] == "store" and path.index("saving") < path.index("committing")
    assert {"committing", "writer", "manifest", "rotation"} <= set(path)
