"""Which modules of the checkpoint package one save goes through, in order: a map for a reader following a save.

    .venv/bin/python scripts/save_path.py [--persist-behind]

Saves a small model once (one process, file:// storage, after a first save so the path is the steady one) with every
thread profiled, and prints the modules entered in order (a run of calls inside one module is one entry), how many
there are, and how many times the path came back to a module it had left."""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import torch

PACKAGE = "trainingrun_trainer.checkpoint."


def save_path(persist_behind: bool) -> list[str]:
    from trainingrun_trainer.checkpoint import CheckpointStore

    model = torch.nn.Linear(64, 64)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    visited: list[str] = []
    lock = threading.Lock()
    recording = threading.Event()

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call" or not recording.is_set():
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith(PACKAGE):
            with lock:
                if not visited or visited[-1] != module:
                    visited.append(module)

    threading.setprofile(profile)  # the store's threads, made as it starts, profile from their first call
    sys.setprofile(profile)
    try:
        with tempfile.TemporaryDirectory() as folder:
            tier = str(Path(folder) / "tier") if persist_behind else None
            with CheckpointStore(f"file://{folder}/ckpt", memory_tier=tier, persist_behind=persist_behind) as store:
                store.save(1, state)
                store.wait()
                recording.set()
                store.save(2, state)
                store.wait()
                if persist_behind:
                    store.flush()
                recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return [name.removeprefix(PACKAGE) for name in visited]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--persist-behind", action="store_true", help="commit in node memory (a folder here)")
    args = parser.parse_args()
    path = save_path(args.persist_behind)
    left: set[str] = set()
    returns = 0
    for before, after in zip(path, path[1:]):
        left.add(before)
        returns += after in left
    print(" -> ".join(path))
    print(f"modules={len(set(path))} entries={len(path)} returns_to_a_module_left={returns}")


if __name__ == "__main__":
    main()
