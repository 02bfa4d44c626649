"""trainingrun_trainer: the in-pod training runtime of trainingrun-operator.

`trainingrun_trainer.config` imports no torch, so the operator can validate trainer configs.
"""
__version__ = "0.1.0"
