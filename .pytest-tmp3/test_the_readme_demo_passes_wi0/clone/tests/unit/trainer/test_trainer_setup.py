"""trainer_setup: the builders the Trainer runs before its first step (spec in, objects out), on one CPU process:
the model with its precision, optimizer, schedule, EMA and guard as the config asks; the data with a sampler that takes
batchSize x gradAccumulationSteps a step and an eval dataset only when evaluation is on; and a dataset that cannot
fill one step refused, saying what to change."""

from __future__ import annotations

import pytest
import torch
from test_session import rank_zero_context

from trainingrun_api.config import TrainerConfig
from trainingrun_trainer import trainer_setup

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SMALL_MODEL = {
    "classPath": "trainingrun_trainer.models.CharTransformer",
    "initArgs": {"dim": 16, "layers": 1, "heads": 2},
}


def config(**fields) -> TrainerConfig:
    return TrainerConfig.from_wire({"model": SMALL_MODEL, "maxSteps": 20, "compile": False, **fields})


def test_one_process_on_cpu_is_not_distributed():
    distributed, device = trainer_setup.init_device(rank_zero_context(), config(), "cpu")
    assert (distributed, device) == (False, torch.device("cpu"))


def test_the_model_gets_the_precision_optimizer_schedule_and_practices_the_config_names():
    parts = trainer_setup.build_model(
        config(precision="bf16-true", ema={"enabled": True, "decay": 0.9}, optimizer={"lr": 0.01}),
        rank_zero_context(),
        torch.device("cpu"),
        "cpu",
        distributed=False,
    )
    assert parts.wrapped is parts.model  # one process, not compiled: nothing wraps it
    assert next(parts.model.parameters()).dtype == torch.bfloat16
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(parts.scheduler.get_last_lr()[0])
    assert parts.ema is not None and parts.ema.decay == 0.9
    assert not parts.scaler.is_enabled() and parts.tokens_per_sample == 64  # the model's default context
    plain = trainer_setup.build_model(config(), rank_zero_context(), torch.device("cpu"), "cpu", distributed=False)
    assert plain.ema is None and next(plain.model.parameters()).dtype == torch.float32


def test_the_sampler_takes_a_whole_step_of_micro_batches_and_eval_data_only_with_evaluation():
    data = trainer_setup.build_data(
        config(data={"batchSize": 4}, gradAccumulationSteps=3), rank_zero_context(world_size=2, rank=1)
    )
    assert data.sampler.samples_per_step == 12 and data.global_batch == 8
    assert (data.sampler.rank, data.sampler.world_size) == (1, 2)
    assert data.eval_dataset is None and data.workers_start is None and data.batch_order is None
    evaluated = trainer_setup.build_data(config(eval={"intervalSteps": 5}), rank_zero_context())
    assert evaluated.eval_dataset is not None and len(evaluated.eval_dataset) > 0


def test_batches_come_from_the_samplers_position_and_a_dataset_too_small_says_what_to_lower():
    cfg = config(data={"batchSize": 2})
    data = trainer_setup.build_data(cfg, rank_zero_context())
    batch = next(trainer_setup.batches(data, cfg, torch.device("cpu"), "cpu"))
    assert batch["tokens"].shape[0] == 2
    tiny = config(
        data={
            "batchSize": 64,
            "dataset": {"classPath": "trainingrun_trainer.data.SyntheticText", "initArgs": {"numSamples": 8}},
        }
    )
    with pytest.raises(ValueError, match="smaller than one global step.*use a larger dataset or a smaller batch"):
        trainer_setup.build_data(tiny, rank_zero_context())


def test_with_no_workers_items_are_read_on_the_training_thread_when_a_batch_is_wanted(monkeypatch):
    """No thread reads ahead (it took the interpreter lock from the step as often as it saved a wait): the items of a
    batch are read on the thread that asks for it, and no sooner."""
    import threading

    cfg = config(data={"batchSize": 2})
    data = trainer_setup.build_data(cfg, rank_zero_context())
    read_on: list[threading.Thread] = []
    original = type(data.dataset).__getitem__

    def getitem(self, index):
        read_on.append(threading.current_thread())
        return original(self, index)

    monkeypatch.setattr(type(data.dataset), "__getitem__", getitem)
    batches = trainer_setup.batches(data, cfg, torch.device("cpu"), "cpu")
    next(batches)
    assert read_on == [threading.current_thread()] * 2  # one batch's items, read here
    next(batches)
    assert len(read_on) == 4 and set(read_on) == {threading.current_thread()}
    batches.close()
