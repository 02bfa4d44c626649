"""How fast a GPU state reaches node memory: the ways a checkpoint can copy it, side by side, in one run.

The state is shaped like the benchmark model's (CharTransformer dim 1024, 12 layers: each layer's four weight matrices,
with AdamW's two moments beside each, fp32: 1.81 GB at the defaults) and lives on one CUDA device. Each way is timed
`--repeats` times (median; the first, which also pays for new pages, apart):

  torch.save /dev/shm   torch.save of the state to a new file in /dev/shm (the reference of issue 37: node memory)
  stager (pinned)       torch's StateDictStager into its reused pinned buffers, as the store stages a GPU state that
                        tier_staging cannot take; the memory tier then copies those bytes once more into its file
  tier file, locked     tier_staging.StagedFile.stage: straight into the tier file's pages, locked for the copy
                        (cudaHostRegister) the first time and kept locked for the saves after it (the tier recycles
                        its files), the store's way for a GPU state
  tier file, pageable   the same with locking unavailable (copies through the driver's pageable path)
  xxh3_128              hashing the staged bytes once (the commit hashes each file once from memory)

    PYTHONPATH=common:trainer_image python3 benchmarks/cuda_staging.py             # one CUDA device, ~30 s
    PYTHONPATH=common:trainer_image python3 benchmarks/cuda_staging.py --device cpu --dim 256   # checks the script

Last line: `result: torch_save_s=... stager_s=... locked_s=... pageable_s=... hash_s=... locked_vs_torch_save=...
locked_first_s=... device=...`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import xxhash

from trainingrun_trainer.checkpoint import tier_staging


def state_like_the_benchmark_model(dim: int, layers: int, device: str) -> dict:
    shapes = [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)]
    weights = {
        f"layer{i}.w{j}": torch.randn(shape, device=device) for i in range(layers) for j, shape in enumerate(shapes)
    }
    moments = {name: {"exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)} for name, w in weights.items()}
    return {"model": weights, "optim": moments}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_staging: torch sees no CUDA device (pass --device cpu to check the script)")
    state = state_like_the_benchmark_model(args.dim, args.layers, args.device)
    nbytes = sum(
        t.numel() * t.element_size()
        for group in state.values()
        for entry in group.values()
        for t in (entry.values() if isinstance(entry, dict) else [entry])
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    root = tempfile.mkdtemp(prefix="cuda-staging-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    figures: dict[str, list[float]] = {}

    def timed(name: str, action) -> None:
        sync()
        began = time.perf_counter()
        action()
        sync()
        figures.setdefault(name, []).append(time.perf_counter() - began)

    def torch_save(index: int) -> None:
        path = os.path.join(root, f"torch-{index}.pt")
        torch.save(state, path)
        os.unlink(path)

    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    stager = StateDictStager(pin_memory=args.device == "cuda")
    real_pin = tier_staging._pin

    def tier_file(name: str, locked: bool) -> None:
        tier_staging._pin = real_pin if locked else (lambda pages: False)
        os.makedirs(os.path.join(root, name, "step"), exist_ok=True)
        staged = tier_staging.StagedFile(os.path.join(root, name, "step", "__0_0.distcp"))  # recycled after the first
        staged.stage(state)
        figures.setdefault(f"{name} pinned", []).append(float(staged.pinned))
        staged.close()

    hashed = []
    for index in range(args.repeats):
        timed("torch.save /dev/shm", lambda index=index: torch_save(index))
        timed("stager (pinned)", lambda: stager.stage(state))
        timed("tier file, locked", lambda: tier_file("locked", True))
        timed("tier file, pageable", lambda: tier_file("pageable", False))
        path = os.path.join(root, "locked", "step", "__0_0.distcp")
        with open(path, "rb") as file:
            data = file.read()
        timed("xxh3_128", lambda data=data: hashed.append(xxhash.xxh3_128(data).hexdigest()))
        del data
    tier_staging._pin = real_pin
    tier_staging.release_locked_pages()
    reference = statistics.median(figures["torch.save /dev/shm"][1:] or figures["torch.save /dev/shm"])
    print(
        f"state: {nbytes / 1e9:.2f} GB on {args.device}; seconds (first, then the median of the rest), GB/s, x torch.save"
    )
    medians = {}
    for name in ("torch.save /dev/shm", "stager (pinned)", "tier file, locked", "tier file, pageable", "xxh3_128"):
        runs = figures[name]
        medians[name] = statistics.median(runs[1:] or runs)
        print(
            f"  {name:22s} first {runs[0]:.3f}  median {medians[name]:.3f} s  {nbytes / medians[name] / 1e9:6.1f} GB/s  "
            f"{medians[name] / reference:.2f}x"
        )
    print(f"  pages locked for the copy: {bool(figures['locked pinned'][-1])}")
    shutil.rmtree(root)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{os.cpu_count()}"
    print(
        f"result: torch_save_s={reference:.4f} stager_s={medians['stager (pinned)']:.4f} "
        f"locked_s={medians['tier file, locked']:.4f} pageable_s={medians['tier file, pageable']:.4f} "
        f"hash_s={medians['xxh3_128']:.4f} locked_vs_torch_save={medians['tier file, locked'] / reference:.4f} "
        f"locked_first_s={figures['tier file, locked'][0]:.4f} locked={bool(figures['locked pinned'][-1])} "
        f"device={device.replace(' ', '_')}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
