"""series: every query of the alerts and dashboards names only series an exporter exports, and the trainer exports
exactly the listed ones."""

import subprocess
import sys

from trainingrun_operator import monitoring, series


def test_every_query_names_only_exported_series():
    for expr in monitoring.every_expression():
        assert series.series_in(expr) <= series.SERIES, expr


def test_the_trainer_exports_exactly_the_listed_series():
    """TrainerMetrics (and its GPU poller, over a stand-in NVML) registers what monitoring lists."""
    script = """
import sys, types
fake = types.SimpleNamespace(
    nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i, NVML_TEMPERATURE_GPU=0,
    nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50),
    nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1, total=2),
    nvmlDeviceGetTemperature=lambda h, s: 40, nvmlDeviceGetPowerUsage=lambda h: 1000,
    nvmlDeviceGetTotalEnergyConsumption=lambda h: 5)
sys.modules["pynvml"] = fake
from prometheus_client import REGISTRY
from trainingrun_trainer.metrics import TrainerMetrics
TrainerMetrics("r", "ns", 0, gpu_index=0, grid_intensity_g_per_kwh=400.0).close()
for family in REGISTRY.collect():
    if family.name.startswith("trainingrun_"):
        print(family.name + ("_total" if family.type == "counter" else ""))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert set(out.split()) == series.TRAINER_SERIES
