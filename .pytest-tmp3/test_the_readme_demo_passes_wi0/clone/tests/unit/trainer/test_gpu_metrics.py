"""gpu_metrics.GpuPoller: NVML's units become the series' units, energy counts only what was used since the last
read (an NVML counter that goes back, as after a driver reload, adds nothing), and emissions are that energy times
the grid's intensity. NVML needs a GPU and its driver, which this machine lacks: a stand-in module answers its calls
here (the GPU machine's suite reads the real one)."""

import sys
import types

import pytest
from prometheus_client import REGISTRY


class FakeNvml(types.ModuleType):
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        super().__init__("pynvml")
        self.busy_percent, self.used, self.total = 40, 3 << 30, 80 << 30
        self.celsius, self.milliwatts, self.energy_mj = 61, 350_000, 1_000_000

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self.busy_percent)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used, total=self.total)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self.celsius

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.milliwatts

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.energy_mj


def sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name, {"run": "r", "rank": "0", "gpu": "2"})
    assert value is not None, name
    return value


def test_nvmls_units_become_the_series_units_and_energy_only_grows(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    from trainingrun_trainer import gpu_metrics

    poller = gpu_metrics.GpuPoller({"run": "r", "rank": "0"}, 2, grid_intensity_g_per_kwh=360.0)
    poller.stop()
    poller.thread.join(10)
    assert not poller.thread.is_alive()
    poller.poll()  # the baseline of the energy counter: nothing used yet
    assert sample("trainingrun_gpu_utilization_ratio") == 0.4
    assert sample("trainingrun_gpu_memory_used_bytes") == 3 << 30
    assert sample("trainingrun_gpu_memory_total_bytes") == 80 << 30
    assert sample("trainingrun_gpu_temperature_celsius") == 61
    assert sample("trainingrun_gpu_power_watts") == 350.0
    energy_before = sample("trainingrun_gpu_energy_joules_total")
    emissions_before = sample("trainingrun_emissions_grams_total")

    nvml.energy_mj += 36_000_000  # 36 kJ = 0.01 kWh
    poller.poll()
    assert sample("trainingrun_gpu_energy_joules_total") - energy_before == pytest.approx(36_000.0)
    assert sample("trainingrun_emissions_grams_total") - emissions_before == pytest.approx(3.6)  # 0.01 kWh x 360 g

    nvml.energy_mj = 5_000  # the counter went back (driver reloaded): nothing added, counting goes on from there
    poller.poll()
    assert sample("trainingrun_gpu_energy_joules_total") - energy_before == pytest.approx(36_000.0)
    nvml.energy_mj += 1_000
    poller.poll()
    assert sample("trainingrun_gpu_energy_joules_total") - energy_before == pytest.approx(36_001.0)


def test_without_a_driver_there_are_no_gpu_series(monkeypatch):
    class NoDriver(types.ModuleType):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", NoDriver("pynvml"))
    from trainingrun_trainer import gpu_metrics

    assert gpu_metrics.nvml_available() is False
