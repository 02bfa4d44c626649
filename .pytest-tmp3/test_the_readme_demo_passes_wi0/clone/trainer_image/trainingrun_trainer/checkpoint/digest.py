"""A digest of a model's weights that does not depend on the world size or the sharding."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import xxhash


def _canonical_name(name: str) -> str:
    # DDP wraps the model in `module.`, torch.compile in `_orig_mod.`: strip them from the front so
    # the same weights give the same digest however they were wrapped.
    changed = True
    while changed:
        changed = False
        for prefix in ("module.", "_orig_mod."):
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def _flatten(tree: Mapping, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def model_digest(state_dict: Mapping[str, Any]) -> str:
    """xxh3_128 over a model's tensors (sha256 before checkpoint format 4: digests from older manifests are not
    comparable with these): for each tensor, in sorted order of its canonical name
    (leading ``module.`` / ``_orig_mod.`` removed), its name, dtype, shape and the bytes of the
    contiguous CPU tensor. Non-tensor entries are ignored; nested dicts are flattened with ".".

    Equal weights give equal digests whatever the world size: replicated (DDP) weights are hashed
    as they are, sharded DTensors (FSDP2) are gathered with ``full_tensor()``, which is a
    collective: with sharded weights, call this on every rank. It tells equal weights from different ones, and
    nothing more: anyone may compute a digest for the weights they choose, so it proves no origin; xxh3_128 hashes at
    memory speed, which matters as rank 0 computes it for every save.
    """
    items = {}
    for name, value in _flatten(state_dict):
        if isinstance(value, torch.Tensor):
            canonical = _canonical_name(name)
            if canonical in items:
                raise ValueError(f"two tensors map to the name {canonical!r}")
            items[canonical] = value
    digest = xxhash.xxh3_128()
    for name in sorted(items):
        tensor = items[name]
        full_tensor = getattr(tensor, "full_tensor", None)
        if full_tensor is not None:  # DTensor
            tensor = full_tensor()
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an array is a buffer
    return digest.hexdigest()


class DigestOfEntry:
    """The `model_digest` of one entry of a staged state (`CheckpointStore.save(model_digest=DigestOfEntry("model"))`):
    rank 0 computes it in the background from its staged copy. Naming the entry lets rank 0 copy only that entry whole
    where its save plan writes part of the state (with several ranks); any other function of the staged state makes it
    copy the whole state."""

    def __init__(self, entry: str = "model"):
        self.entry = entry

    def __call__(self, staged: Mapping[str, Any]) -> str:
        return model_digest(staged[self.entry])


# --------------------------------------------------------------------------------------------
