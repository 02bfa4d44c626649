"""Model FLOP/s and MFU (model FLOPs utilisation): what a run's steps achieve against what its accelerators can do.

Model FLOPs of one sample, forward and backward: the model's own `flops_per_sample()` (the built-in models count
6 x matmul parameters x tokens plus attention, the PaLM/nanoGPT count; a user's model may define the same method), or
`spec.trainer.flopsPerSample`, which wins when both are there. Neither: no FLOP figures at all.

The peak: the dense tensor throughput of the run's precision on the device, from `PEAKS` by the device's name (as
NVML and `nvidia-smi` give it), or `spec.trainer.peakFlopsPerSecond`. A GPU the table lacks is named in one warning and
reports FLOP/s only; a CPU run reports FLOP/s and no MFU (a CPU has no one peak worth dividing by).

MFU = model FLOP/s / (ranks x peak). It counts the model's arithmetic only: recomputed activations
(activationCheckpointing) and padding do not count, so it can be compared across settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("trainingrun.efficiency")

#: (part of the device name, dense bf16/fp16 FLOP/s, dense TF32 FLOP/s, FP32 FLOP/s), from the vendors' datasheets
#: (SXM parts unless named); the first whose part is in the name applies, so longer names come before their prefixes.
PEAKS: tuple[tuple[str, float, float, float], ...] = (
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100 PCIe", 756e12, 378e12, 51.2e12),
    ("H100", 989.4e12, 494.7e12, 66.9e12),
    ("H200", 989.4e12, 494.7e12, 66.9e12),
    ("H800", 989.4e12, 494.7e12, 66.9e12),
    ("B200", 2250e12, 1100e12, 75e12),
    ("A100", 312e12, 156e12, 19.5e12),
    ("A800", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("L40", 181e12, 90.5e12, 90.5e12),
    ("L4", 121e12, 60e12, 30.3e12),
    ("A10G", 70e12, 35e12, 31.2e12),
    ("A10", 125e12, 62.5e12, 31.2e12),
    ("V100", 125e12, 15.7e12, 15.7e12),  # fp16 tensor cores; no TF32 (32-bit matmuls run at FP32)
    ("T4", 65e12, 8.1e12, 8.1e12),  # the same
)

#: Precisions whose matmuls run in 16-bit (spec.trainer.precision).
SIXTEEN_BIT = ("bf16-mixed", "bf16-true", "16-mixed")


def device_peak(device_name: str, precision: str, tf32: bool) -> Optional[float]:
    """The dense peak FLOP/s of `device_name` for `precision` (`tf32`: 32-bit matmuls run in TF32); None when the table
    lacks the device."""
    for part, sixteen, tensor_float, single in PEAKS:
        if part in device_name:
            return sixteen if precision in SIXTEEN_BIT else tensor_float if tf32 else single
    return None


def model_flops_per_sample(model: Any, configured: Optional[int] = None) -> Optional[int]:
    """Forward and backward FLOPs of one sample: `configured` (the spec's), else the model's `flops_per_sample()`."""
    if configured is not None:
        return configured
    counts = getattr(model, "flops_per_sample", None)
    return int(counts()) if callable(counts) else None


@dataclass(frozen=True)
class Efficiency:
    """FLOP/s and MFU of a run from its throughput. `flops_per_sample` None: no figures; `peak` None: no MFU."""

    flops_per_sample: Optional[int]
    peak: Optional[float]  #: FLOP/s of one rank's device
    world_size: int = 1

    def flops_per_second(self, samples_per_second: Optional[float]) -> Optional[float]:
        """The run's model FLOP/s at `samples_per_second` (over all ranks)."""
        if self.flops_per_sample is None or samples_per_second is None:
            return None
        return self.flops_per_sample * samples_per_second

    def mfu(self, samples_per_second: Optional[float]) -> Optional[float]:
        """The run's MFU: its model FLOP/s over every rank's peak."""
        achieved = self.flops_per_second(samples_per_second)
        if achieved is None or not self.peak:
            return None
        return achieved / (self.peak * self.world_size)


def for_run(
    model: Any,
    precision: str,
    device: Any,
    world_size: int,
    flops_per_sample: Optional[int] = None,
    peak_flops_per_second: Optional[float] = None,
) -> Efficiency:
    """The run's `Efficiency` on `device` (a torch.device): the peak from the spec or the table, for CUDA devices."""
    flops = model_flops_per_sample(model, flops_per_sample)
    peak = peak_flops_per_second
    if peak is None and getattr(device, "type", "cpu") == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        peak = device_peak(name, precision, tf32)
        if peak is None:
            log.warning(
                "MFU is not reported: %r is not in the table of GPU peaks; set spec.trainer.peakFlopsPerSecond "
                "to the device's dense FLOP/s for %s (model FLOP/s are reported)",
                name,
                precision,
            )
    if flops is None:
        log.info(
            "model FLOP/s and MFU are not reported: the model has no flops_per_sample() and "
            "spec.trainer.flopsPerSample is not set"
        )
    return Efficiency(flops, peak, world_size)


def compiles(setting: Optional[bool], on_gpus: bool) -> bool:
    """Whether a run compiles its model: spec.trainer.compile, or, unset, when it trains on GPUs."""
    return bool(setting) or (setting is None and on_gpus)


def compiled(module: Any, setting: Optional[bool], device_type: str) -> Any:
    """`module` wrapped by torch.compile where `setting` (spec.trainer.compile) says, or, unset, on GPUs. Compiling by
    default must not fail a run the user never asked to compile: there a frame torch.compile cannot take runs as it
    is (torch logs why); an explicit `true` lets the error end the run."""
    if not compiles(setting, device_type == "cuda"):
        return module
    import torch

    if setting is None:
        from .torch_internals import dynamo_config

        dynamo_config().suppress_errors = True
    return torch.compile(module)
