"""Trainer metrics: off unless the launcher serves them; NVML read in the background, never in a step."""

import subprocess
import sys
import textwrap

import pytest


def run_python(script: str, **env) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        check=True,
        env=full,
        timeout=120,
    ).stdout


def test_metrics_are_off_without_the_launchers_directory():
    out = run_python("""
        from trainingrun_trainer.context import RunContext
        from trainingrun_trainer import metrics
        context = RunContext.from_env({"TRAININGRUN_CONFIG": "x"})
        print(type(metrics.for_rank(context, "cpu")).__name__)
    """)
    assert out.strip() == "NullMetrics"


def test_cpu_ranks_have_no_gpu_series(tmp_path):
    out = run_python(
        """
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from trainingrun_trainer.context import RunContext
        from trainingrun_trainer import metrics
        context = RunContext.from_env({"TRAININGRUN_CONFIG": "x", "TRAININGRUN_NAME": "r", "RANK": "1"})
        m = metrics.for_rank(context, "cpu")
        m.step(step=3, loss=1.5, learning_rate=0.1, grad_norm=2.0, step_seconds=0.2, data_wait_seconds=0.01,
               productive_seconds=0.6)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=%r)
        print(generate_latest(registry).decode())
    """
        % str(tmp_path),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
    )
    assert 'trainingrun_step{namespace="default",rank="1",run="r"} 3.0' in out
    assert 'trainingrun_loss{namespace="default",rank="1",run="r"} 1.5' in out
    assert "trainingrun_gpu" not in out and "trainingrun_emissions" not in out


def test_nvml_polling_never_blocks_a_step():
    """A stand-in NVML that hangs until released: steps still record (NVML is read in its own thread);
    were a step to call NVML, this would hang and the subprocess timeout would fail the test."""
    out = run_python("""
        import sys, threading, types
        gate, inside = threading.Event(), threading.Event()
        def hang(*args):
            inside.set()
            gate.wait()
            return types.SimpleNamespace(gpu=50, used=1, total=2)
        sys.modules["pynvml"] = types.SimpleNamespace(
            nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i, NVML_TEMPERATURE_GPU=0,
            nvmlDeviceGetUtilizationRates=hang, nvmlDeviceGetMemoryInfo=hang, nvmlDeviceGetTemperature=hang,
            nvmlDeviceGetPowerUsage=hang, nvmlDeviceGetTotalEnergyConsumption=hang)
        from trainingrun_trainer.metrics import TrainerMetrics
        m = TrainerMetrics("r", "ns", 0, gpu_index=0)
        inside.wait()  # the poller is now stuck inside NVML
        for step in range(100):
            m.step(step=step, loss=1.0, learning_rate=0.1, grad_norm=1.0, step_seconds=0.1,
                   data_wait_seconds=0.0, productive_seconds=step * 0.1)
        print("steps recorded while NVML hung:", m._step._value.get())
        gate.set()
        m.close()
    """)
    assert out.strip() == "steps recorded while NVML hung: 99.0"


def expositions_after(tmp_path, *calls: str) -> list[str]:
    """The rank's exposition after each call on its metrics `m` (in a fresh process, as the launcher serves them)."""
    script = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from trainingrun_trainer.context import RunContext
        from trainingrun_api.progress_report import IntervalChoice
        from trainingrun_trainer import metrics
        context = RunContext.from_env({"TRAININGRUN_CONFIG": "x", "TRAININGRUN_NAME": "r"})
        m = metrics.for_rank(context, "cpu")
        def exposition():
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=%r)
            return generate_latest(registry).decode()
    """
        % str(tmp_path)
    ) + "".join(f"{call}\nprint(exposition())\nprint('----')\n" for call in calls)
    return run_python(script, PROMETHEUS_MULTIPROC_DIR=str(tmp_path)).split("----")[:-1]


def test_eval_series_are_absent_until_the_first_evaluation(tmp_path):
    before, after = expositions_after(tmp_path, "pass", 'm.evaluation(40, {"eval_loss": 2.25})')
    assert "trainingrun_eval" not in before  # no made-up 0 loss before any evaluation
    assert 'trainingrun_eval_loss{namespace="default",rank="0",run="r"} 2.25' in after
    assert 'trainingrun_eval_step{namespace="default",rank="0",run="r"} 40.0' in after
    assert "trainingrun_eval_loss_ema{" not in after  # no EMA, no series


def test_the_straggler_series_are_absent_until_measured_and_the_ratio_is_rank_zeros(tmp_path):
    before, own, compared = expositions_after(
        tmp_path,
        "m.spread(None, None)",
        "m.spread(0.25, None)",  # a rank other than 0, or rank 0 before the ranks compare
        "from trainingrun_trainer.stragglers import Spread\nm.spread(0.25, Spread(3, 0.5, 0.2))",
    )
    assert "trainingrun_rank_compute_seconds{" not in before and "trainingrun_slowest_rank" not in before
    assert 'trainingrun_rank_compute_seconds{namespace="default",rank="0",run="r"} 0.25' in own
    assert "trainingrun_slowest_rank_ratio{" not in own
    assert 'trainingrun_slowest_rank_ratio{namespace="default",rank="0",run="r"} 2.5' in compared
    assert 'trainingrun_slowest_rank{namespace="default",rank="0",run="r"} 3.0' in compared


def test_the_auto_intervals_series_appear_with_what_was_measured(tmp_path):
    fixed, early, measured = expositions_after(
        tmp_path,
        "m.checkpoint_interval(None)",  # a fixed interval
        "m.checkpoint_interval(IntervalChoice(10, None, None, 3600.0, 0, None))",  # nothing measured yet
        "m.checkpoint_interval(IntervalChoice(120, 12.0, 0.05, 600.0, 2, 6.0))",
    )
    assert "trainingrun_checkpoint_interval_steps" not in fixed
    assert 'trainingrun_checkpoint_interval_steps{namespace="default",rank="0",run="r"} 10.0' in early
    assert "trainingrun_checkpoint_expected_lost_seconds{" not in early  # not a made-up 0
    assert 'trainingrun_checkpoint_expected_lost_seconds{namespace="default",rank="0",run="r"} 6.0' in measured
    assert 'trainingrun_checkpoint_save_cost_seconds{namespace="default",rank="0",run="r"} 0.05' in measured


@pytest.mark.slow
def test_the_persist_lag_is_what_memory_holds_beyond_storage_and_zero_where_saves_commit_to_storage(tmp_path):
    store = textwrap.dedent("""
        from trainingrun_trainer.checkpoint.context import StoreMetrics
        class Store:  # what metrics reads of a CheckpointStore on rank 0
            rank = 0
            def __init__(self, behind, lag, failed):
                self.metrics = StoreMetrics(failed_persists=failed)
                self.persist_behind, self.persist_lag_steps = behind, lag
    """)
    behind, to_storage = expositions_after(
        tmp_path, store + "m.checkpoints(Store(True, 20, 2))", "m.checkpoints(Store(False, 0, 2))"
    )
    labels = '{namespace="default",rank="0",run="r"}'
    assert f"trainingrun_checkpoint_persist_lag_steps{labels} 20.0" in behind
    assert f"trainingrun_checkpoint_persist_failures_total{labels} 2.0" in behind
    assert f"trainingrun_checkpoint_persist_lag_steps{labels} 0.0" in to_storage  # present, so the panel has data


def test_model_flops_are_each_ranks_share_and_mfu_is_absent_without_a_peak(tmp_path):
    step = (
        "m.step(step=3, loss=1.5, learning_rate=0.1, grad_norm=2.0, step_seconds=0.2, data_wait_seconds=0.01, "
        "productive_seconds=0.6, samples_per_second=100.0, model_flops_per_second=4e12{})"
    )
    script = """
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from trainingrun_trainer.context import RunContext
        from trainingrun_trainer import metrics
        context = RunContext.from_env({"TRAININGRUN_CONFIG": "x", "TRAININGRUN_NAME": "r", "RANK": "1",
                                       "WORLD_SIZE": "4"})
        m = metrics.for_rank(context, "cpu")
        %s
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=%r)
        print(generate_latest(registry).decode())
    """
    (tmp_path / "cpu").mkdir()
    (tmp_path / "gpu").mkdir()
    cpu = run_python(script % (step.format(""), str(tmp_path / "cpu")), PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "cpu"))
    gpu = run_python(
        script % (step.format(", mfu=0.42"), str(tmp_path / "gpu")), PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "gpu")
    )
    assert 'trainingrun_model_flops_per_second{namespace="default",rank="1",run="r"} 1e+12' in cpu
    assert "trainingrun_mfu_ratio{" not in cpu  # a CPU run: FLOP/s, no made-up MFU
    assert 'trainingrun_mfu_ratio{namespace="default",rank="1",run="r"} 0.42' in gpu


def test_the_startup_series_has_every_phase_once_the_first_step_ran(tmp_path):
    before, after = expositions_after(
        tmp_path,
        "pass",
        "from trainingrun_trainer.timekeeping import ProcessClock\n"
        "now = [100.0]\n"
        "clock = ProcessClock('pod-0', now=lambda: now[0])\n"
        "for phase, at in (('imports', 104.0), ('init', 104.5), ('model', 106.0), ('data', 106.25)):\n"
        "    now[0] = at\n"
        "    clock.mark(phase)\n"
        "clock.add('restore', 2.0)\n"
        "now[0] = 108.5\n"
        "clock.ready()\n"
        "clock.first_step_done(1.5)\n"
        "m.startup(clock)",
    )
    assert "trainingrun_startup_seconds{" not in before
    for phase, seconds in (
        ("imports", 4.0),
        ("init", 0.5),
        ("model", 1.5),
        ("data", 0.25),
        ("prepare", 0.25),
        ("restore", 2.0),
        ("first_step", 1.5),
    ):
        assert f'trainingrun_startup_seconds{{namespace="default",phase="{phase}",rank="0",run="r"}} {seconds}' in after


@pytest.mark.slow
def test_restore_bytes_are_counted_by_source_from_the_stores_totals(tmp_path):
    store = textwrap.dedent("""
        from trainingrun_trainer.checkpoint import tier_files
        from trainingrun_trainer.checkpoint.context import StoreMetrics
        from trainingrun_trainer.metrics import RESTORE_SOURCES
        assert RESTORE_SOURCES == (tier_files.OWN_MEMORY, tier_files.PEER, tier_files.STORAGE)
        class Store:  # what metrics reads of a CheckpointStore after its restores
            rank, persist_lag_steps = 1, 0
            def __init__(self, restores, own_memory, storage):
                self.metrics = StoreMetrics(restores=restores, restore_bytes={"own_memory": own_memory, "storage": storage})
    """)
    none, first, second = expositions_after(
        tmp_path, store, "m.checkpoints(Store(1, 5000, 0))", "m.checkpoints(Store(2, 5000, 700))"
    )
    series = 'trainingrun_checkpoint_restore_bytes_total{namespace="default",rank="0",run="r",source="%s"} %s'
    assert series % ("own_memory", "0.0") in none and series % ("storage", "0.0") in none  # present from the start
    assert series % ("own_memory", "5000.0") in first and series % ("storage", "0.0") in first
    assert series % ("own_memory", "5000.0") in second and series % ("storage", "700.0") in second
