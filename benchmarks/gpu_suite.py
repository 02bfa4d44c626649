"""The GPU checks of the checkpoint issue (37) in one command, with the machine's own torch and nothing fetched.

Runs, on one CUDA device, the model of the first H100 measurement (CharTransformer dim 1024, 12 layers, 16 heads:
151.5 M parameters + AdamW = 1,818 MB of state):

  checkpoint_stall.py --device cuda ... --repeats 3 --restore-from file
      save-to-commit and background CPU against torch.save to the same disk, the effective stall, and restores from
      this machine's disk and from the memory tier (/dev/shm) against torch.load (the storage emulators are not
      installed on a GPU machine, so storage is file:// here);
  trainer_overhead.py --device cuda --nproc 1 ... --context 256 --batch-size 32 --precision bf16-mixed
      --checkpoint-every 10 --repeats 1 --compile
      the trainer against a bare loop, and with an async checkpoint every 10 steps (`ckpt_overhead_ratio`);
  gpu_defaults.py --variants fused,compile,recompile,graphs
      the model in a bare loop with the trainer's GPU defaults, with torch.compile from an empty cache (`compile_s`),
      again in a new process that finds the cache (`recompile_startup_s`: process start to the first trained step),
      and with CUDA graphs (mode="reduce-overhead");
  restart_in_place.py --modes compile
      `trainingrun local` of the minimal example with compile on, a worker SIGKILLed at step 60 and restarted in
      place by torchrun: the kill to the first trained step again (`restart_to_training_s`).

First it runs the unit tests that need a GPU (`GPU_TESTS`; `--no-tests` skips them; their verdict is `gpu_tests=`).
It prints every output as it comes and ends with one line:

  result: ckpt_overhead_ratio=... ckpt_vs_trainer=... commit_vs_torch_save=... background_cpu_ratio=...
          effective_stall_ratio=... memory_restore_vs_torch_load=... overhead_ratio=... device=... torch=...

(ckpt_overhead_ratio: the trainer with a checkpoint every 10 steps / the bare loop; ckpt_vs_trainer: / the trainer
without one; commit_vs_torch_save: a checkpoint committed in node memory, persisting behind as the trainer does, /
torch.save; persist_vs_torch_save: its copy to storage after that; background_cpu_ratio_persist_behind: the CPU of both
tiers / torch.save's. `--repeats` and `--overhead-repeats` trade figures' spread for time.) Targets (issue 37): ckpt_vs_trainer <= 1.03 (a memory checkpoint every 10 steps costs <= 3%),
commit_vs_torch_save <= 0.5, background_cpu_ratio <= 1.5, memory_restore_vs_torch_load <= 0.2 (beside it
memory_restore_vs_copy_floor, the restore against copying its bytes alone, and copy_floor_vs_torch_load, that copy
against torch.load: what the target leaves for everything else on that machine),
storage_restore_vs_fsspec >= 0.8 (a restore from the machine's disk against fsspec reading the same files).

On the GPU machine (torch 2.11 there, no registry, no pydantic): carry the wheels `bash scripts/gpu-wheels.sh` puts in
.whl/ (pydantic and its needs, for Python 3.12), then, in one device call:

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
  PYTHONPATH=/tmp/site:$PWD/common:$PWD/trainer_image:$PWD/operator PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py

`--multinode` runs, instead of the four, multinode_checkpoint.py --device cuda --mib 1800 (issue 63: two "pods" on one GPU, each staging
from CUDA into its own memory tier and writing the other's files, against one pod; `multinode_commit_ratio`,
`multinode_storage_bytes_read` for the in-place restore; not yet run on a GPU). `--large` runs, instead of the four,
trainer_overhead.py for a ~1B-parameter model (dim 2048, 20 layers, context 1024, batch 8, bf16, compiled): issue 64's
second config, `large_mfu` (goal 45%) and `large_overhead_ratio` (trainer / bare compiled loop; not yet run). About 8 minutes on one H200 (tests 15 s, checkpoint_stall 110 s, trainer_overhead 175 s, restart_in_place ~60 s
(estimated: not yet run on a GPU), gpu_defaults 100 s): give the device call 580 s. `--quick` (a smaller model, 2 repeats) checks the script itself, also on CPU (`--device cpu`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = ["--dim", "1024", "--layers", "12", "--heads", "16"]
QUICK_MODEL = ["--dim", "768", "--layers", "3", "--heads", "12"]
#: Issue 64's second config: about 1B parameters (12 x 2048^2 x 20 = 1.01 B), context 1024 (`--large`).
LARGE_MODEL = ["--dim", "2048", "--layers", "20", "--heads", "16", "--context", "1024", "--batch-size", "8"]
#: Unit tests with cases that run only where CUDA is (staging GPU tensors into the memory tier, compile defaults).
GPU_TESTS = [
    "tests/unit/trainer/checkpoint/test_checkpoint_tier_staging.py",
    "tests/unit/trainer/test_efficiency.py",
    "tests/unit/trainer/test_trainer.py",  # issue 64: a step on the GPU never synchronises, by CUDA's sync debug mode
    "tests/unit/trainer/test_loading.py",  # issue 64: batches copied a batch ahead on a stream of their own
    "tests/unit/trainer/test_hangs.py",  # issue 80: an NCCL group's collectives read from torch's flight recorder
    "tests/unit/trainer/test_stragglers.py",  # issue 80: a step's device time from CUDA events, never a device sync
]


def run(script: str, args: list[str], timeout: float) -> dict[str, str]:
    """Run a benchmark, echoing its output; the fields of its last `result:` line."""
    command = [sys.executable, str(HERE / script), *args]
    print(f"== {' '.join(command[1:])}", flush=True)
    began = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = threading.Timer(timeout, process.kill)  # also when it hangs without printing
    deadline.start()
    lines = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        code = process.wait()
    finally:
        deadline.cancel()
    results = [line for line in lines if line.startswith("result: ")]
    if code != 0 or not results:
        print(f"== {script} exited {code} after {time.monotonic() - began:.0f} s without a result line", flush=True)
        return {}
    print(f"== {script}: {time.monotonic() - began:.0f} s", flush=True)
    return dict(re.findall(r"(\w+)=(\S+)", results[-1]))


def overhead_args(device: str, model: list[str], checkpoint_every: int, steps: int, repeats: int) -> list[str]:
    """trainer_overhead.py's arguments for one process of `model`: bf16 and compiled on a GPU (the trainer's
    defaults there, both sides), metrics and reporting rows left out."""
    return [
        "--device",
        device,
        "--nproc",
        "1",
        *model,
        "--precision",
        "bf16-mixed" if device == "cuda" else "32-true",
        "--checkpoint-every",
        str(checkpoint_every),
        "--steps",
        str(steps),
        "--no-metrics",
        "--no-reporting",
        "--repeats",
        str(repeats),
        *(["--compile"] if device == "cuda" else []),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="a smaller model and 2 repeats: checks the script")
    parser.add_argument("--timeout", type=float, default=330, help="seconds each benchmark may take (default 330)")
    parser.add_argument("--repeats", type=int, default=3, help="checkpoint_stall's repeats (default 3)")
    parser.add_argument("--no-tests", action="store_true", help="skip the unit tests that need a GPU")
    parser.add_argument("--overhead-repeats", type=int, default=1, help="trainer_overhead's repeats (default 1)")
    parser.add_argument(
        "--multinode",
        action="store_true",
        help="instead of the suite: multinode_checkpoint.py from the device, two pods' commit in memory against one "
        "pod's (issue 63; a device call of its own, about 3 minutes)",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="instead of the suite: the trainer against the bare loop for a ~1B-parameter model, context 1024, bf16, "
        "compiled (issue 64's MFU goal 45%%; a device call of its own, about 5 minutes, not yet run)",
    )
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_suite: torch sees no CUDA device (pass --device cpu to check the script on a CPU)")
    tests = "skipped"
    if not args.no_tests:  # the unit tests that need a GPU (skipped on CPUs): the staging path the figures time
        print(f"== pytest {' '.join(GPU_TESTS)}", flush=True)
        tests = (
            "passed"
            if subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-o",
                    "addopts=",
                    "--tb=short",
                    *GPU_TESTS,
                ],
                cwd=HERE.parent,
            ).returncode
            == 0
            else "failed"
        )
    stall: dict[str, str] = {}
    overhead: dict[str, str] = {}
    restart: dict[str, str] = {}
    defaults: dict[str, str] = {}
    large: dict[str, str] = {}
    if args.large:
        large = run(
            "trainer_overhead.py",
            overhead_args(
                args.device,
                QUICK_MODEL + ["--context", "64", "--batch-size", "4"] if args.quick else LARGE_MODEL,
                checkpoint_every=0,
                steps=40 if args.quick else 60,
                repeats=1,
            ),
            args.timeout,
        )
    if not args.multinode and not args.large:
        model = QUICK_MODEL if args.quick else MODEL
        repeats = "2" if args.quick else str(args.repeats)
        stall = run(
            "checkpoint_stall.py",
            [
                "--device",
                args.device,
                *model,
                "--repeats",
                repeats,
                "--restore-from",
                "file",
                "--restore-repeats",
                "2" if args.quick else "3",
                "--dir",
                "/tmp",
            ],
            args.timeout,
        )
        overhead = run(
            "trainer_overhead.py",
            overhead_args(
                args.device,
                model + ["--context", "64" if args.quick else "256", "--batch-size", "4" if args.quick else "32"],
                checkpoint_every=10,
                steps=60 if args.quick else 160,
                repeats=2 if args.quick else args.overhead_repeats,
            ),
            args.timeout,
        )  # the trainer's GPU default, both sides
        restart = run(
            "restart_in_place.py", ["--modes", "compile"], args.timeout
        )  # a worker killed mid-run, compile on
        defaults = run(
            "gpu_defaults.py",
            [
                "--device",
                args.device,
                "--variants",
                "fused,compile,recompile,graphs",
                *(["--quick"] if args.quick else []),
            ],
            args.timeout,
        )
    multinode = (
        run(
            "multinode_checkpoint.py",
            ["--device", args.device, "--mib", "64" if args.quick else "1800", "--repeats", "2", "--saves", "3"],
            args.timeout,
        )
        if args.multinode
        else {}
    )
    ckpt_vs_trainer = "nan"
    if overhead.get("ckpt_overhead_ratio") and overhead.get("overhead_ratio"):
        # the checkpoint row against the trainer without one: what checkpointing every 10 steps alone costs
        ckpt_vs_trainer = f"{float(overhead['ckpt_overhead_ratio']) / float(overhead['overhead_ratio']):.4f}"
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{os.cpu_count()}"
    fields = {
        "ckpt_overhead_ratio": overhead.get("ckpt_overhead_ratio", "nan"),
        "ckpt_vs_trainer": ckpt_vs_trainer,
        "commit_vs_torch_save": stall.get("commit_vs_torch_save", "nan"),
        "persist_vs_torch_save": stall.get("persist_vs_torch_save", "nan"),
        "background_cpu_ratio_persist_behind": stall.get("background_cpu_ratio_persist_behind", "nan"),
        "background_cpu_ratio": stall.get("background_cpu_ratio", "nan"),
        "effective_stall_ratio": stall.get("effective_stall_ratio", "nan"),
        "memory_restore_vs_torch_load": stall.get("memory_restore_vs_torch_load", "nan"),
        "memory_restore_vs_copy_floor": stall.get("memory_restore_vs_copy_floor", "nan"),
        "copy_floor_vs_torch_load": stall.get("copy_floor_vs_torch_load", "nan"),
        "storage_restore_vs_fsspec": stall.get("storage_restore_vs_fsspec", "nan"),
        "mfu": overhead.get("mfu", "nan"),
        "model_tflops": overhead.get("model_tflops", "nan"),
        "startup_s": overhead.get("startup_s", "nan"),
        "overhead_ratio": overhead.get("overhead_ratio", "nan"),
        "compile_mfu": defaults.get("compile_mfu", "nan"),
        "graphs_mfu": defaults.get("graphs_mfu", "nan"),
        "compile_s": defaults.get("compile_s", "nan"),
        "restart_to_training_s": restart.get("restart_to_training_s", "nan"),
        "recompile_startup_s": defaults.get("recompile_startup_s", "nan"),
        "multinode_commit_ratio": multinode.get("ratio", "nan"),
        "multinode_storage_bytes_read": multinode.get("storage_bytes_read_nodes", "nan"),
        "large_mfu": large.get("mfu", "nan"),
        "large_overhead_ratio": large.get("overhead_ratio", "nan"),
        "gpu_tests": tests,
        "device": device.replace(" ", "_"),
        "torch": torch.__version__,
    }
    print("result: " + " ".join(f"{key}={value}" for key, value in fields.items()), flush=True)
    return 0 if (multinode if args.multinode else large if args.large else stall and overhead) else 1


if __name__ == "__main__":
    sys.exit(main())
