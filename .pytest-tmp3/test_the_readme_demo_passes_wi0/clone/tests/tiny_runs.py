"""Trainer configs small enough for CPU tests: one place, so every test trains the same tiny model."""

import copy


def tiny_model(layers: int = 1) -> dict:
    """A 16-wide CharTransformer over 16 characters of context: a step takes milliseconds."""
    return {
        "classPath": "trainingrun_trainer.models.CharTransformer",
        "initArgs": {"dim": 16, "layers": layers, "heads": 2, "contextLength": 16},
    }


def tiny_trainer(samples: int = 4096, layers: int = 1, **overrides) -> dict:
    """`spec.trainer` for the tiny model on seeded synthetic text, batch 8; overrides win."""
    config = {
        "model": tiny_model(layers),
        "data": {
            "dataset": {
                "classPath": "trainingrun_trainer.data.SyntheticText",
                "initArgs": {"numSamples": samples, "contextLength": 16},
            },
            "batchSize": 8,
        },
    }
    config.update(copy.deepcopy(overrides))
    return config
