"""preloading: the launcher's forkserver starts before torch only for the built-in trainer (settling the thread count
as torchrun would), and preloads torch.compile's modules exactly when the run will compile; a config it cannot read
preloads the usual modules (the trainer reports what is wrong with it)."""

import pytest
import yaml

from trainingrun_api import contract
from trainingrun_trainer import preloading


@pytest.mark.parametrize(
    "argv, env, starts, omp",
    [
        (["--module", "trainingrun_trainer"], {"PET_NPROC_PER_NODE": "2"}, True, "1"),  # as torchrun would set it
        (["--nproc-per-node=2", "--module", "trainingrun_trainer"], {"OMP_NUM_THREADS": "4"}, True, "4"),
        (["--nproc_per_node", "1", "-m", "trainingrun_trainer"], {}, True, None),
        (["--nproc-per-node=auto", "--module", "trainingrun_trainer"], {}, False, None),  # torch decides later
        (["--module", "my_trainer"], {}, False, None),  # any other program: exactly torchrun
        (["train.py", "--data", "trainingrun_trainer"], {}, False, None),
    ],
)
def test_the_forkserver_starts_before_torch_only_for_the_builtin_trainer(monkeypatch, argv, env, starts, omp):
    from multiprocessing import forkserver

    started = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(True))
    assert preloading.start_forkserver(argv, env) is starts
    assert bool(started) is starts
    assert env.get("OMP_NUM_THREADS") == omp


@pytest.mark.parametrize(
    "trainer, gpus, compiles",
    [
        ({"compile": True}, False, True),
        ({"compile": False}, True, False),
        ({}, True, True),  # the trainer's default: compile with GPUs
        ({}, False, False),
    ],
)
def test_the_forkserver_preloads_torch_compile_when_the_run_will_compile(
    monkeypatch, tmp_path, trainer, gpus, compiles
):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": trainer, "checkpoint": {"uri": "file:///ckpt"}}))
    monkeypatch.setattr(preloading, "node_has_gpus", lambda: gpus)
    modules = preloading.preload({contract.CONFIG: str(config)})
    assert set(preloading.PRELOAD) <= set(modules)
    assert ("trainingrun_trainer.compile_preload" in modules) is compiles


@pytest.mark.parametrize("content", [None, "trainer: [unclosed", "- a list", "trainer: 3"])
def test_a_config_the_launcher_cannot_read_preloads_the_usual_modules(tmp_path, content):
    config = tmp_path / "config.yaml"
    if content is not None:
        config.write_text(content)
    assert preloading.preload({contract.CONFIG: str(config)}) == preloading.PRELOAD
