"""step_values: a step's loss, gradient norm and non-finite flags reach the host in step order, late or drained."""

from __future__ import annotations

import math

import pytest
import torch

from trainingrun_trainer.step_values import LateValues, StepValues, found_inf, step_tensor


@pytest.mark.parametrize(
    ("loss", "norm", "expected"),
    [
        (1.0, 2.0, [0.0, 0.0]),
        (math.nan, 2.0, [1.0, 0.0]),
        (1.0, math.inf, [0.0, 1.0]),
        (-math.inf, math.nan, [1.0, 1.0]),
    ],
)
def test_flags_say_which_of_loss_and_gradient_norm_is_not_finite(loss, norm, expected):
    values = step_tensor(torch.tensor(loss), torch.tensor(norm))
    assert values[2:].tolist() == expected and found_inf(values).item() == max(expected)


def test_values_come_back_in_step_order_once_and_a_clear_forgets_them():
    late = LateValues(torch.device("cpu"))
    late.put(1, 0.1, step_tensor(torch.tensor(2.5), torch.tensor(0.5)))
    late.put(2, 0.2, step_tensor(torch.tensor(math.nan), torch.tensor(0.25)))
    first, second = late.ready()
    assert first == StepValues(1, 0.1, 2.5, 0.5, loss_finite=True, grad_finite=True)
    assert (second.step, second.learning_rate, second.grad_norm) == (2, 0.2, 0.25)
    assert math.isnan(second.loss) and not second.loss_finite and second.grad_finite
    assert late.ready() == [] and late.drain() == []
    late.put(3, 0.3, step_tensor(torch.tensor(1.0), torch.tensor(math.inf)))
    late.clear()
    assert late.drain() == []


def test_a_value_is_a_copy_the_step_after_cannot_change():
    late = LateValues(torch.device("cpu"))
    loss = torch.tensor(3.0)
    late.put(1, 0.1, step_tensor(loss, torch.tensor(1.0)))
    loss.add_(1.0)  # the next step's accumulation reusing the tensor
    assert late.drain()[0].loss == 3.0
