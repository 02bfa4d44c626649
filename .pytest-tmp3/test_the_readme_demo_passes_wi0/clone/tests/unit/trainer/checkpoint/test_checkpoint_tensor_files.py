"""Format 3's data files (checkpoint/tensor_files.py): tensors stored as their bytes, read back into any destination,
refused by name by DCP's stock reader, and older formats still read."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import (  # noqa: F401 - fixtures
    app_state,
    assert_same,
    make_model,
    rewrite_with_a_valid_manifest,
    root,
    step_dir,
    store,
    trained,
    weights,
    write_sha256_manifest,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore
from trainingrun_trainer.checkpoint.tensor_files import RAW_TENSOR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def store(root):
    with CheckpointStore(root.as_uri()) as opened:
        yield opened


def metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def test_every_tensor_is_stored_as_its_bytes(store, root):
    model, opt = trained()
    store.save(3, app_state(model, opt), {"step": 3}, blocking=True)
    directory = step_dir(root, 3)
    stored = metadata(directory)
    tensors = {
        index.fqn: info
        for index, info in stored.storage_data.items()
        if isinstance(stored.state_dict_metadata[index.fqn], dcp.metadata.TensorStorageMetadata)
    }
    assert tensors and all(info.transform_descriptors == [RAW_TENSOR] for info in tensors.values())
    assert (
        json.loads((directory / MANIFEST_NAME).read_text())["format_version"] == 4
    )  # format 3 stored tensors so; 4 adds xxh3_128 digests
    data = (directory / "__0_0.distcp").read_bytes()
    for name, value in model.state_dict().items():
        info = tensors[f"model.{name}"]
        assert data[info.offset : info.offset + info.length] == value.contiguous().numpy().tobytes(), name


def test_dcps_own_reader_refuses_them_by_name_rather_than_misread_them(store, root):
    model, opt = trained()
    store.save(3, app_state(model, opt), {"step": 3}, blocking=True)
    with pytest.raises(BaseException, match=f"Unknown extension name='{RAW_TENSOR.split('/')[0]}'"):
        dcp.load(
            {"model": make_model(1).state_dict()}, storage_reader=FsspecReader(str(step_dir(root, 3))), no_dist=True
        )


def test_tensors_load_into_other_dtypes_and_non_contiguous_destinations(store):
    weight = torch.randn(6, 4)
    info = store.save(
        1, {"weight": weight, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}, blocking=True
    ).result()
    as_bf16, transposed = torch.zeros(6, 4, dtype=torch.bfloat16), torch.zeros(4, 6).t()
    state = {"weight": as_bf16, "scalar": torch.tensor(0.0), "empty": torch.ones(0, 3)}
    store.load(info, state)
    assert torch.equal(as_bf16, weight.to(torch.bfloat16)) and state["scalar"].item() == 2.5
    state["weight"] = transposed  # not contiguous: read through a buffer, then copied in
    store.load(info, state)
    assert torch.equal(transposed, weight)


def test_a_data_file_cut_short_fails_the_load_and_says_where(store, root):
    model, opt = trained()
    store.save(3, app_state(model, opt), {"step": 3}, blocking=True)
    data = step_dir(root, 3) / "__0_0.distcp"
    # Someone fixed the manifest to match (so only loading can tell): the last tensor lacks its last 4 bytes.
    rewrite_with_a_valid_manifest(step_dir(root, 3), data.name, data.read_bytes()[:-4])
    with pytest.raises(ckpt.CheckpointLoadError, match=r"an item of .* lies past the end of __0_0.distcp"):
        store.load(store.latest_valid(), app_state(*trained(seed=5)))


def test_a_format_2_checkpoint_still_loads(store, root):
    """As trainer images before format 3 wrote it: DCP's torch.save archive per tensor, extra as the rank's entry."""

    model = make_model(1)
    directory = step_dir(root, 4)
    extra = io.BytesIO()
    torch.save({"step": 4}, extra)
    dcp.save(
        {"model": model.state_dict(), "extra-rank-0": extra.getvalue()},
        storage_writer=FsspecWriter(f"file://{directory}"),
        no_dist=True,
    )
    write_sha256_manifest(directory, 2, 4)
    info = store.latest_valid()
    assert info.step == 4 and info.format_version == 2
    loaded = make_model(2)
    assert store.load(info, {"model": loaded.state_dict()}) == {"step": 4}
    assert_same(weights(loaded), weights(model))


def _plan(items: dict, prefix: str = "__0_"):
    """A final save plan of `items` ({fqn: bytes or tensor}) as DCP hands a rank's to its writer, and its resolver."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix as Prefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    write_items, values = [], {}
    for fqn, value in items.items():
        index = MetadataIndex(fqn)
        if isinstance(value, bytes):
            write_items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        else:
            kind = WriteItemType.SHARD if fqn.startswith("shard") else WriteItemType.TENSOR
            chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=value.shape)
            data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=value.dtype), size=value.shape)
            write_items.append(WriteItem(index=index, type=kind, tensor_data=data))
        values[fqn] = io.BytesIO(value) if isinstance(value, bytes) else value
    return SavePlan(write_items, storage_data=Prefix(prefix)), lambda item: values[item.index.fqn]


@pytest.mark.parametrize("apart", [True, False])
def test_a_ranks_replicated_items_may_go_into_a_file_of_their_own(tmp_path, apart):
    """A sharded state on several pods: every item but the shards and the rank's own entry goes into
    ``__<rank>_replicated.distcp`` (which every pod keeps); without `apart` one file holds them all, as before."""
    from trainingrun_trainer.checkpoint.tensor_files import write_rank_file

    items = {
        "shard.w": torch.arange(6, dtype=torch.float32),
        "optim.step": torch.tensor(3.0),
        "optim.lr": b"lr-bytes",
        "extra-rank-0": b"own",
    }
    plan, resolve = _plan(items)
    pick = (lambda item: item.type.name != "SHARD" and item.index.fqn != "extra-rank-0") if apart else None
    results = write_rank_file(
        lambda path, mode: open(path, mode), lambda a, b: f"{a}/{b}", str(tmp_path), plan, resolve, False, apart=pick
    )
    where = {result.index.fqn: result.storage_data.relative_path for result in results}
    replicated = "__0_replicated.distcp" if apart else "__0_0.distcp"
    assert where == {
        "shard.w": "__0_0.distcp",
        "extra-rank-0": "__0_0.distcp",
        "optim.step": replicated,
        "optim.lr": replicated,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"__0_0.distcp", replicated})
    for result in results:  # each item lies where its result says
        with open(tmp_path / result.storage_data.relative_path, "rb") as f:
            f.seek(result.storage_data.offset)
            data = f.read(result.storage_data.length)
        value = items[result.index.fqn]
        assert data == (value if isinstance(value, bytes) else value.numpy().tobytes())


def test_no_file_of_replicated_items_is_written_for_a_rank_that_has_none(tmp_path):
    from trainingrun_trainer.checkpoint.tensor_files import write_rank_file

    plan, resolve = _plan({"shard.w": torch.ones(2), "extra-rank-1": b"own"}, prefix="__1_")
    write_rank_file(
        lambda path, mode: open(path, mode),
        lambda a, b: f"{a}/{b}",
        str(tmp_path),
        plan,
        resolve,
        False,
        apart=lambda item: item.type.name != "SHARD" and item.index.fqn != "extra-rank-1",
    )
    assert [p.name for p in tmp_path.iterdir()] == ["__1_0.distcp"]
