"""efficiency: model FLOP/s and MFU from a run's throughput, the model's FLOP count and its device's peak."""

import logging

import pytest
import torch

from trainingrun_trainer import efficiency
from trainingrun_trainer.models import CharTransformer


@pytest.mark.parametrize(
    "name, precision, tf32, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", False, 989.4e12),
        ("NVIDIA H100 PCIe", "bf16-mixed", False, 756e12),
        ("NVIDIA H100 NVL", "16-mixed", False, 835e12),
        ("NVIDIA H200", "bf16-true", False, 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "32-true", True, 156e12),
        ("NVIDIA A100-SXM4-40GB", "32-true", False, 19.5e12),
        ("NVIDIA A10G", "bf16-mixed", False, 70e12),  # not the A100's, though its name starts the same
        ("NVIDIA L40S", "bf16-mixed", False, 362e12),
        ("NVIDIA L4", "bf16-mixed", False, 121e12),
        ("NVIDIA B200", "bf16-mixed", False, 2250e12),
    ],
)
def test_the_peak_is_the_devices_dense_throughput_at_the_runs_precision(name, precision, tf32, peak):
    assert efficiency.device_peak(name, precision, tf32) == peak


def test_a_device_the_table_lacks_has_no_peak():
    assert efficiency.device_peak("NVIDIA Quantum Accelerator 9000", "bf16-mixed", False) is None


def test_mfu_is_the_runs_model_flops_over_every_ranks_peak():
    run = efficiency.Efficiency(flops_per_sample=2_000_000, peak=1e9, world_size=4)
    assert run.flops_per_second(1000.0) == 2e9
    assert run.mfu(1000.0) == pytest.approx(0.5)
    assert run.mfu(None) is None


def test_a_cpu_run_reports_flops_and_no_mfu():
    model = CharTransformer(vocab_size=32, dim=32, layers=1, heads=2, context_length=16)
    run = efficiency.for_run(model, "32-true", torch.device("cpu"), world_size=2)
    assert run.flops_per_sample == model.flops_per_sample() and run.peak is None
    assert run.flops_per_second(10.0) == 10 * model.flops_per_sample() and run.mfu(10.0) is None


def test_the_spec_wins_over_the_models_count_and_the_table():
    model = CharTransformer(vocab_size=32, dim=32, layers=1, heads=2, context_length=16)
    run = efficiency.for_run(
        model, "32-true", torch.device("cpu"), world_size=1, flops_per_sample=1000, peak_flops_per_second=1e6
    )
    assert run.mfu(100.0) == pytest.approx(0.1)


def test_an_unknown_gpu_is_said_once_and_reports_flops_only(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Quantum Accelerator 9000")
    model = CharTransformer(vocab_size=32, dim=32, layers=1, heads=2, context_length=16)
    with caplog.at_level(logging.WARNING, logger="trainingrun.efficiency"):
        run = efficiency.for_run(model, "bf16-mixed", torch.device("cuda", 0), world_size=1)
    assert run.peak is None and run.flops_per_second(1.0) == model.flops_per_sample()
    [said] = [r.getMessage() for r in caplog.records]
    assert "Quantum Accelerator 9000" in said and "spec.trainer.peakFlopsPerSecond" in said


def test_a_model_without_a_count_reports_no_flops():
    run = efficiency.for_run(torch.nn.Linear(2, 2), "32-true", torch.device("cpu"), world_size=1)
    assert run.flops_per_second(5.0) is None and run.mfu(5.0) is None


@pytest.mark.parametrize(
    "setting, device_type, wrapped, lenient",
    [
        (None, "cuda", True, True),  # unset: on with GPUs, and a frame it cannot compile runs as it is
        (None, "cpu", False, False),  # unset: off on CPUs
        (True, "cpu", True, False),  # asked for: also on CPUs, and its errors end the run
        (True, "cuda", True, False),
        (False, "cuda", False, False),
    ],
)
def test_the_model_is_compiled_on_gpus_unless_the_spec_says_otherwise(setting, device_type, wrapped, lenient):
    import torch._dynamo as dynamo

    model = torch.nn.Linear(2, 2)
    with dynamo.config.patch(suppress_errors=False):  # restored after: the setting is the process's
        result = efficiency.compiled(model, setting, device_type)  # wrapping compiles nothing until the first call
        assert dynamo.config.suppress_errors == lenient
    assert (result is not model) == wrapped and isinstance(result, torch.nn.Module)
    if wrapped:
        assert result._orig_mod is model
