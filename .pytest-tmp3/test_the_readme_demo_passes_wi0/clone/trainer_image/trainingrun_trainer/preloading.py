"""What the launcher's forkserver imports before it forks the trainer's workers (launch.py starts it): the trainer and
what its first step imports lazily, and the compiler's modules when the run compiles, so a worker group restarted in
place starts in well under a second. Decided without importing torch."""

from __future__ import annotations

import os
from typing import Any, Sequence

from trainingrun_api import contract

TRAINER_MODULE = "trainingrun_trainer"
#: Imported once by the forkserver, so forked workers start with them loaded: the trainer and
#: what its first step imports lazily (DDP and the optimizers pull in torch._dynamo, ~0.3 s each time).
PRELOAD = [
    "trainingrun_trainer.main",
    "trainingrun_trainer.trainer",
    "trainingrun_trainer.models",
    "trainingrun_trainer.data",
    "torch._dynamo",
    "torch.distributed.checkpoint.state_dict",
    "numpy.random",
    "fsspec.implementations.local",
]
#: Preloaded too when the run compiles its model: what every worker's torch.compile would pay again (compile_preload).
COMPILE_PRELOAD = ["trainingrun_trainer.compile_preload"]


def preload(env: Any = os.environ) -> list[str]:
    """The modules the forkserver imports: PRELOAD, and COMPILE_PRELOAD where the trainer config
    (TRAININGRUN_CONFIG) asks for `compile: true`, or leaves it unset on a node with GPUs (the trainer's default,
    `efficiency.compiled`). Read before torch is imported, so a config this cannot read preloads less and the
    trainer itself reports what is wrong with it."""
    return PRELOAD + COMPILE_PRELOAD if _will_compile(env) else list(PRELOAD)


def node_has_gpus() -> bool:
    """Whether this node shows NVIDIA GPUs to this container, judged without importing torch."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _will_compile(env: Any) -> bool:
    import yaml

    try:
        with open(env.get(contract.CONFIG, ""), encoding="utf-8") as f:
            trainer = (yaml.safe_load(f) or {}).get("trainer") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return False
    from .efficiency import compiles  # torch-free at import

    setting = trainer.get("compile") if isinstance(trainer, dict) else None
    return isinstance(setting, (bool, type(None))) and compiles(setting, node_has_gpus())


def start_forkserver(argv: Sequence[str], env: Any = os.environ) -> bool:
    """Start the preloading forkserver before this process imports torch (~2 s in a new container), when `argv`
    runs the built-in trainer: its imports (3-6 s) then overlap the agent's own and the wait for the other pods
    in rendezvous. Started by the first worker group, they came after it: a replacement pod trained 4-6 s later.
    The forkserver keeps the environment it starts with, so OMP_NUM_THREADS is settled first, as torchrun would
    (1 thread per worker when a pod runs several and the user set none). Returns whether it started it."""
    import multiprocessing
    from multiprocessing import forkserver

    module = "--module" in argv or "-m" in argv or env.get("PET_MODULE", "").lower() in ("1", "true")
    if not (module and TRAINER_MODULE in argv and "--no-python" not in argv and "--no_python" not in argv):
        return False
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    for i, arg in enumerate(argv):
        if arg.startswith(("--nproc-per-node", "--nproc_per_node")):
            nproc = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
    if not nproc.isdigit():  # "auto", "gpu": torchrun decides once torch is imported
        return False
    if int(nproc) > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload(env))
    forkserver.ensure_running()
    return True
