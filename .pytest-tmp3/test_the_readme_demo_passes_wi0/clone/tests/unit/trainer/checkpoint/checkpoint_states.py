"""What the checkpoint tests share: a small model, a training step, the state DCP saves, and the store below a
tmp_path (fixtures `root` and `store`, which a test module imports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def wrapped(seed: int, sharded: bool) -> torch.nn.Module:
    """The test model as DDP, or sharded by FSDP2 over every rank (each rank's file then holds its own shards)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(seed)
    if not sharded:
        return DDP(model)
    fully_shard(model)
    return model


def local_digest(model: torch.nn.Module) -> str:
    """This rank's part of the model (its shards, or the whole replica)."""
    from trainingrun_trainer.checkpoint import model_digest

    plain = model.module if hasattr(model, "module") else model
    return model_digest({k: v.to_local() if hasattr(v, "to_local") else v for k, v in plain.state_dict().items()})


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


def rewrite_with_a_valid_manifest(directory: Path, name: str, content: bytes) -> None:
    """Someone who may write the bucket replaces a file and fixes the manifest to match."""
    import xxhash

    (directory / name).write_bytes(content)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["size"], entry["xxh3_128"] = len(content), xxhash.xxh3_128(content).hexdigest()
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def write_sha256_manifest(directory: Path, format_version: int, step: int) -> None:
    """The manifest a trainer before format 3 wrote for every file of `directory`: sha256 digests."""
    import hashlib

    files = [
        {"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(directory.iterdir())
    ]
    manifest = {
        "format_version": format_version,
        "step": step,
        "time": "2026-11-20T00:00:00Z",
        "world_size": 1,
        "config_hash": "",
        "model_digest": "",
        "torch_version": torch.__version__,
        "files": files,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def store(root):
    with CheckpointStore(f"file://{root}", keep=10) as s:
        yield s


def spawned(worker, nprocs: int, out_dir, *args) -> list[dict]:
    """Run `worker(rank, *args)` on `nprocs` spawned ranks; each rank's `rank<N>.json` in `out_dir`, in rank order."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=args, nprocs=nprocs, join=True)
    return [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(nprocs)]
