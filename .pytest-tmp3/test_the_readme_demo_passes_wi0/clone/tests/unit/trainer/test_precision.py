"""precision: which dtype autocast and the weights get per mode, the scaler only for fp16, and the modes a device
cannot run refused before any process group exists, naming the field and what to use instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainingrun_trainer.precision import PrecisionPlan, check_supported


@pytest.mark.parametrize(
    "precision, autocast, weights",
    [
        ("32-true", None, torch.float32),
        ("16-mixed", torch.float16, torch.float32),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("bf16-true", None, torch.bfloat16),
    ],
)
def test_each_mode_names_its_autocast_and_weight_dtypes(precision, autocast, weights):
    plan = PrecisionPlan(precision, "cpu")
    assert plan.autocast_dtype == autocast
    assert plan.param_dtype == weights
    assert plan.prepare(nn.Linear(2, 2)).weight.dtype == weights


def test_bf16_mixed_runs_matmuls_in_bfloat16_and_32_true_does_not():
    x = torch.ones(2, 2)
    with PrecisionPlan("bf16-mixed", "cpu").autocast():
        assert (x @ x).dtype == torch.bfloat16
    with PrecisionPlan("32-true", "cpu").autocast():
        assert (x @ x).dtype == torch.float32


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
def test_only_fp16_gets_an_enabled_grad_scaler():
    assert PrecisionPlan("16-mixed", "cuda").grad_scaler().is_enabled() == torch.cuda.is_available()
    assert not PrecisionPlan("bf16-mixed", "cpu").grad_scaler().is_enabled()


def test_fp16_on_cpu_is_refused_with_the_field_and_the_alternatives():
    with pytest.raises(ValueError, match=r"spec\.trainer\.precision: 16-mixed needs a CUDA GPU.*bf16-mixed or 32-true"):
        check_supported("16-mixed", "cpu")
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        check_supported(precision, "cpu")


def test_bf16_on_a_gpu_without_bfloat16_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="bf16-true needs a GPU with bfloat16 support.*use 16-mixed"):
        check_supported("bf16-true", "cuda")
