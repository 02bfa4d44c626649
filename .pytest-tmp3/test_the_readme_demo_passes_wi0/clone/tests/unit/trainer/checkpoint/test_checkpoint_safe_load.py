"""safe_load: nothing read from storage runs code (DCP's metadata unpickled by exact allowed names only), and the
plain values a trainer saves come back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import app_state, make_model, rewrite_with_a_valid_manifest, root, step_dir, store, trained  # noqa: F401 - fixtures
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint.safe_load import _MetadataUnpickler

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCode:
    """Unpickling this runs code: it creates the file at `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


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
