"""digest.model_digest: equal weights give equal digests however the model was wrapped (DDP's `module.`, compile's
`_orig_mod.`) and whatever the order of the entries; any change of a value, dtype, shape or name changes it."""

from __future__ import annotations

import pytest
import torch

from trainingrun_trainer.checkpoint.digest import DigestOfEntry, model_digest


def weights() -> dict:
    torch.manual_seed(0)
    return {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3), "step": 5}


def test_wrapping_and_order_do_not_change_the_digest():
    plain = weights()
    wrapped = {f"module._orig_mod.{name}": value for name, value in reversed(list(plain.items()))}
    nested = {"layer": {"weight": plain["layer.weight"], "bias": plain["layer.bias"]}}
    assert model_digest(plain) == model_digest(wrapped) == model_digest(nested)


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w["layer.bias"].add_(1e-7),
        lambda w: w.update({"layer.bias": w["layer.bias"].double()}),
        lambda w: w.update({"layer.weight": w["layer.weight"].reshape(4, 3)}),
        lambda w: w.update({"layer.b": w.pop("layer.bias")}),
    ],
    ids=["value", "dtype", "shape", "name"],
)
def test_any_change_of_the_weights_changes_it(change):
    changed = weights()
    change(changed)
    assert model_digest(changed) != model_digest(weights())


def test_non_contiguous_and_empty_tensors_hash_as_their_contents():
    w = weights()
    assert model_digest({"t": w["layer.weight"].t()}) == model_digest({"t": w["layer.weight"].t().contiguous()})
    assert model_digest({"e": torch.empty(0)}) != model_digest({"e": torch.empty(0, 2)})


def test_two_tensors_under_one_canonical_name_are_refused():
    with pytest.raises(ValueError, match="two tensors map to the name 'w'"):
        model_digest({"w": torch.ones(1), "module.w": torch.ones(1)})


def test_the_digest_of_an_entry_is_that_entrys():
    w = weights()
    assert DigestOfEntry("model")({"model": w, "optim": {"x": torch.ones(1)}}) == model_digest(w)
