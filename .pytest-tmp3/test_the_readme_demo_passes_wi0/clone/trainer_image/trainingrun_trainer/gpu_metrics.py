"""This rank's GPU as Prometheus series (utilization, memory, temperature, power, energy and the emissions estimate),
read through NVML by a thread of its own (metrics.py serves them)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

log = logging.getLogger("trainingrun.metrics")

#: How often NVML is read, at most: once a second, however often Prometheus scrapes.
GPU_POLL_SECONDS = 1.0


class GpuPoller:
    """Reads this rank's GPU through NVML in a thread, at most once a second; a step never waits for it."""

    def __init__(self, labels: dict[str, str], index: int, grid_intensity_g_per_kwh: Optional[float]):
        import pynvml
        from prometheus_client import Counter, Gauge

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        labels = {**labels, "gpu": str(index)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, multiprocess_mode="livemostrecent").labels(**labels)

        self.utilization = gauge("trainingrun_gpu_utilization_ratio", "GPU busy fraction over NVML's sample period.")
        self.memory_used = gauge("trainingrun_gpu_memory_used_bytes", "GPU memory in use.")
        self.memory_total = gauge("trainingrun_gpu_memory_total_bytes", "GPU memory installed.")
        self.temperature = gauge("trainingrun_gpu_temperature_celsius", "GPU temperature.")
        self.power = gauge("trainingrun_gpu_power_watts", "GPU power draw.")
        self.energy = Counter("trainingrun_gpu_energy_joules", "GPU energy since this process started.", names).labels(
            **labels
        )
        self.emissions = None
        if grid_intensity_g_per_kwh:
            self.grams_per_joule = grid_intensity_g_per_kwh / 3.6e6
            self.emissions = Counter(
                "trainingrun_emissions_grams", "Estimated CO2e: GPU energy x grid intensity.", names
            ).labels(**labels)
        self._energy_mj: Optional[int] = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainingrun-nvml", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 - a flaky sensor must never stop training
                log.debug("NVML poll failed: %s", error)
            self._stop.wait(GPU_POLL_SECONDS)

    def poll(self) -> None:
        nvml, handle = self.nvml, self.handle
        self.utilization.set(nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        self.memory_used.set(memory.used)
        self.memory_total.set(memory.total)
        self.temperature.set(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        self.power.set(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        energy_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        if self._energy_mj is not None and energy_mj >= self._energy_mj:
            joules = (energy_mj - self._energy_mj) / 1000.0
            self.energy.inc(joules)
            if self.emissions is not None:
                self.emissions.inc(joules * self.grams_per_joule)
        self._energy_mj = energy_mj

    def stop(self) -> None:
        self._stop.set()


def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU series
        return False
