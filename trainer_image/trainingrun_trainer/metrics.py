"""Prometheus metrics of a training process, and the endpoint that serves every rank's.

Each rank writes its series to files (prometheus-client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR);
the launcher, torchrun's agent, which outlives in-place restarts of its workers, serves all ranks
of the pod on TRAININGRUN_METRICS_PORT (`serve`). Without that port nothing is recorded at all
(`NullMetrics`), so metrics cost nothing when off.

Series (labels run, namespace, rank; GPU series add gpu; base units; counters end in _total):

    trainingrun_step, trainingrun_loss, trainingrun_learning_rate, trainingrun_grad_norm
    trainingrun_samples_per_second, trainingrun_tokens_per_second (models that count tokens)
    trainingrun_model_flops_per_second (this rank's share), trainingrun_mfu_ratio (GPUs with a known peak)
    trainingrun_step_duration_seconds, trainingrun_data_wait_seconds            histograms
    trainingrun_last_step_timestamp_seconds                                       for stall alerts
    trainingrun_productive_seconds, trainingrun_goodput_ratio                     this attempt's view
    trainingrun_startup_seconds{phase}                 this process's start-up to its first step, by phase
    trainingrun_checkpoint_save_seconds, trainingrun_checkpoint_restore_seconds   histograms
    trainingrun_checkpoint_saved_bytes_total, trainingrun_checkpoint_failures_total
    trainingrun_checkpoint_restore_bytes_total{source}  bytes restores read: own_memory (this node's) or storage
    trainingrun_checkpoint_wait_seconds_total          saves waiting for the one before them (interval < a commit)
    trainingrun_checkpoint_persist_lag_steps           steps the newest checkpoint in memory is ahead of storage's
    trainingrun_checkpoint_persist_failures_total      memory checkpoints that could not be copied to storage
    trainingrun_nonfinite_steps_total, trainingrun_rollbacks_total
    trainingrun_eval_loss, trainingrun_eval_loss_ema, trainingrun_eval_step  the last evaluation (spec.trainer.eval)
    trainingrun_gpu_utilization_ratio, trainingrun_gpu_memory_used_bytes, trainingrun_gpu_memory_total_bytes,
    trainingrun_gpu_temperature_celsius, trainingrun_gpu_power_watts, trainingrun_gpu_energy_joules_total
    trainingrun_emissions_grams_total                  energy x GRID_INTENSITY_G_PER_KWH (spec.env), when set

GPU series exist only where NVML finds this rank's GPU: absent, not zero, on CPU.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from typing import Any, Optional

from trainingrun_api import contract, run_figures

from .gpu_metrics import GpuPoller, nvml_available

#: The sources of trainingrun_checkpoint_restore_bytes_total: checkpoint.tier_files' OWN_MEMORY, PEER and STORAGE (named
#: here as well: the launcher imports this module, and the checkpoint package imports torch).
RESTORE_SOURCES = ("own_memory", "peer", "storage")

log = logging.getLogger("trainingrun.metrics")

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
CHECKPOINT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class NullMetrics:
    """Metrics off: every call is a no-op."""

    def step(self, **_: Any) -> None:
        pass

    def checkpoints(self, store: Any, waited_seconds: float = 0.0) -> None:
        pass

    def checkpoint_interval(self, choice: Any) -> None:
        pass

    def startup(self, clock: Any) -> None:
        pass

    def nonfinite_step(self) -> None:
        pass

    def spread(self, own_seconds: Optional[float], spread: Any) -> None:
        pass

    def rollback(self) -> None:
        pass

    def evaluation(self, step: int, results: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TrainerMetrics(NullMetrics):
    """This rank's series, label children bound once; `step()` is a handful of float writes."""

    def __init__(
        self,
        run: str,
        namespace: str,
        rank: int,
        gpu_index: Optional[int] = None,
        grid_intensity_g_per_kwh: Optional[float] = None,
        attempt: int = 1,
        group_restarts: int = 0,
        world_size: int = 1,
    ):
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"run": run, "namespace": namespace, "rank": str(rank)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, multiprocess_mode="livemostrecent").labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, names, buckets=buckets).labels(**labels)

        self._step = gauge("trainingrun_step", "Last completed optimizer step.")
        self._loss = gauge("trainingrun_loss", "Training loss of the last step on this rank.")
        self._lr = gauge("trainingrun_learning_rate", "Learning rate of the first parameter group.")
        self._grad_norm = gauge("trainingrun_grad_norm", "Global gradient norm before clipping.")
        self._samples = gauge("trainingrun_samples_per_second", "Samples per second over all ranks, last window.")
        self._tokens = gauge("trainingrun_tokens_per_second", "Tokens per second over all ranks, last window.")
        # Absent until a value comes: models that do not count their FLOPs have none, CPUs and unknown GPUs no MFU.
        self._flops = Gauge(
            "trainingrun_model_flops_per_second",
            "This rank's share of the run's model FLOP/s, last window (sum over ranks: the run's).",
            names,
            multiprocess_mode="livemostrecent",
        )
        self._mfu = Gauge(
            "trainingrun_mfu_ratio",
            "Model FLOP/s of this rank over its device's dense peak at the "
            "run's precision, last window (average over ranks: the run's MFU).",
            names,
            multiprocess_mode="livemostrecent",
        )
        self._world_size = max(1, world_size)
        self._startup = Gauge(
            "trainingrun_startup_seconds",
            "This process's start-up by phase, to its first step "
            "(imports, init, model, data, prepare, restore, first_step): the phases add up to it.",
            names + ["phase"],
            multiprocess_mode="livemostrecent",
        )
        self._last_step = gauge("trainingrun_last_step_timestamp_seconds", "Unix time of the last completed step.")
        self._productive = gauge(
            "trainingrun_productive_seconds", "Step time kept in the current model, data wait excluded."
        )
        self._goodput = gauge("trainingrun_goodput_ratio", "Productive seconds over this attempt's wall time.")
        gauge("trainingrun_attempt", "Attempt number (TRAININGRUN_ATTEMPT).").set(attempt)
        gauge(
            "trainingrun_worker_group_restarts",
            "In-place restarts of this attempt's worker group (TORCHELASTIC_RESTART_COUNT).",
        ).set(group_restarts)
        self._step_seconds = histogram(
            "trainingrun_step_duration_seconds", "Wall time of one optimizer step.", STEP_BUCKETS
        )
        self._data_wait = histogram(
            "trainingrun_data_wait_seconds", "Time a step waited for its batches.", WAIT_BUCKETS
        )
        self._save_seconds = histogram(
            "trainingrun_checkpoint_save_seconds", "Staging start to commit of a checkpoint.", CHECKPOINT_BUCKETS
        )
        self._restore_seconds = histogram(
            "trainingrun_checkpoint_restore_seconds", "Time to load a checkpoint.", CHECKPOINT_BUCKETS
        )
        self._saved_bytes = counter("trainingrun_checkpoint_saved_bytes", "Bytes this rank wrote to checkpoints.")
        restore_bytes = Counter(
            "trainingrun_checkpoint_restore_bytes",
            "Bytes this rank's restores read, by where they came from: own_memory (its node's memory) or storage.",
            [*names, "source"],
        )
        self._restore_bytes = {source: restore_bytes.labels(**labels, source=source) for source in RESTORE_SOURCES}
        self._save_failures = counter("trainingrun_checkpoint_failures", "Checkpoints that were not committed.")
        self._save_wait = counter(
            "trainingrun_checkpoint_wait_seconds",
            "Time saves waited for the save before them to commit (an interval shorter than a commit).",
        )
        self._persist_lag = gauge(
            "trainingrun_checkpoint_persist_lag_steps",
            "Steps the newest checkpoint in node memory is ahead of the newest in storage "
            "(checkpoint.persistBehind; rank 0).",
        )
        self._persist_failures = counter(
            "trainingrun_checkpoint_persist_failures",
            "Checkpoints committed in node memory that could not be copied to storage.",
        )
        self._nonfinite = counter("trainingrun_nonfinite_steps", "Steps with a non-finite loss or gradient.")
        # Stragglers (stragglers.py): absent until measured; the ratio and the slowest rank on rank 0 only.
        self._own_seconds = Gauge(
            "trainingrun_rank_compute_seconds",
            "This rank's part of its last step before the step's first collective (data wait and forward passes): "
            "a straggler's is longer than the other ranks'.",
            names,
            multiprocess_mode="livemostrecent",
        )
        self._slowest = {
            name: Gauge(f"trainingrun_{name}", doc, names, multiprocess_mode="livemostrecent")
            for name, doc in (
                ("slowest_rank_ratio", "The slowest rank's compute time over the other ranks' median (rank 0)."),
                ("slowest_rank", "The rank with the longest compute time over the last steps (rank 0)."),
            )
        }
        self._rollbacks = counter("trainingrun_rollbacks", "Rollbacks to the last good checkpoint.")
        # Series without a value until the first evaluation: absent, never a made-up 0 loss.
        self._eval = {
            name: Gauge(f"trainingrun_{name}", doc, names, multiprocess_mode="livemostrecent")
            for name, doc in (
                ("eval_loss", "Mean loss on the held-out split at the last evaluation."),
                ("eval_loss_ema", "The same with the EMA weights (spec.trainer.ema)."),
                ("eval_step", "Step of the last evaluation."),
            )
        }
        # Only with checkpoint.interval.steps or storageInterval.steps: auto, on rank 0: absent otherwise.
        self._interval = {
            name: Gauge(f"trainingrun_checkpoint_{name}", doc, names, multiprocess_mode="livemostrecent")
            for name, doc in (
                ("interval_steps", "The interval checkpoint.interval.steps: auto chose."),
                (
                    "save_cost_seconds",
                    "What one save costs the training loop: blocking plus the "
                    "slowdown of the steps beside the background write.",
                ),
                ("expected_lost_seconds", "Training a failure throws away on average at that interval (half of it)."),
                (
                    "storage_interval_steps",
                    "The storage interval checkpoint.storageInterval.steps: auto chose (absent: every checkpoint).",
                ),
                (
                    "persist_cost_seconds",
                    "What one copy to storage costs the training loop: the slowdown of the steps beside it.",
                ),
            )
        }
        self._labels = labels
        for child in (
            self._save_failures,
            self._nonfinite,
            self._rollbacks,
            self._saved_bytes,
            self._save_wait,
            self._persist_failures,
            *self._restore_bytes.values(),
        ):
            child.inc(0)  # present from the start, so alerts see 0 rather than nothing
        self._started = time.monotonic()
        self._seen = {"committed": 0, "failed": 0, "restores": 0, "waited": 0.0, "persist_failed": 0}
        self._gpu = GpuPoller(labels, gpu_index, grid_intensity_g_per_kwh) if gpu_index is not None else None

    def step(  # type: ignore[override]  # NullMetrics.step takes any keywords and does nothing
        self,
        *,
        step: int,
        loss: float,
        learning_rate: float,
        grad_norm: float,
        step_seconds: float,
        data_wait_seconds: float,
        productive_seconds: float,
        samples_per_second: Optional[float] = None,
        tokens_per_second: Optional[float] = None,
        model_flops_per_second: Optional[float] = None,
        mfu: Optional[float] = None,
    ) -> None:
        """`samples_per_second`, `tokens_per_second`, `model_flops_per_second`: over all ranks; `mfu`: the run's."""
        self._step.set(step)
        self._loss.set(loss)
        self._lr.set(learning_rate)
        self._grad_norm.set(grad_norm)
        self._step_seconds.observe(step_seconds)
        self._data_wait.observe(data_wait_seconds)
        self._last_step.set(time.time())
        self._productive.set(productive_seconds)
        self._goodput.set(run_figures.goodput(productive_seconds, time.monotonic() - self._started) or 0.0)
        if samples_per_second is not None:
            self._samples.set(samples_per_second)
        if tokens_per_second is not None:
            self._tokens.set(tokens_per_second)
        if model_flops_per_second is not None:  # each rank does its share of the samples
            self._flops.labels(**self._labels).set(model_flops_per_second / self._world_size)
        if mfu is not None:
            self._mfu.labels(**self._labels).set(mfu)

    def startup(self, clock: Any) -> None:
        """Once, at the first step: where the process's start-up went (`timekeeping.ProcessClock`)."""
        for phase, seconds in clock.snapshot().startup_parts().items():
            self._startup.labels(**self._labels, phase=phase).set(seconds)

    def checkpoints(self, store: Any, waited_seconds: float = 0.0) -> None:
        """Record what the checkpoint store did since the last call (its own counters), and `waited_seconds`: the
        seconds saves waited for the one before them so far (`Run.checkpoint_wait_seconds`)."""
        if waited_seconds > self._seen["waited"]:
            self._save_wait.inc(waited_seconds - self._seen["waited"])
            self._seen["waited"] = waited_seconds
        if store.metrics.committed_saves > self._seen["committed"]:
            self._seen["committed"] = store.metrics.committed_saves
            self._save_seconds.observe(store.metrics.last_save_seconds)
            self._saved_bytes.inc(store.metrics.last_save_bytes)
        if store.metrics.failed_saves > self._seen["failed"]:
            self._save_failures.inc(store.metrics.failed_saves - self._seen["failed"])
            self._seen["failed"] = store.metrics.failed_saves
        if store.rank == 0:  # 0 where saves commit to storage (several pods, persistBehind: false)
            self._persist_lag.set(store.persist_lag_steps)
            if store.metrics.failed_persists > self._seen["persist_failed"]:
                self._persist_failures.inc(store.metrics.failed_persists - self._seen["persist_failed"])
                self._seen["persist_failed"] = store.metrics.failed_persists
        if store.metrics.restores > self._seen["restores"]:
            self._seen["restores"] = store.metrics.restores
            self._restore_seconds.observe(store.metrics.last_restore_seconds)
            for source, read in store.metrics.restore_bytes.items():
                counted = self._seen.setdefault(f"restore bytes {source}", 0)
                if source in self._restore_bytes and read > counted:
                    self._restore_bytes[source].inc(read - counted)
                    self._seen[f"restore bytes {source}"] = read

    def checkpoint_interval(self, choice: Any) -> None:
        """The auto interval's choice (a progress_report.IntervalChoice; None: not auto): parts not yet measured stay absent."""
        if choice is None:
            return
        for name, value in (
            ("interval_steps", choice.steps),
            ("save_cost_seconds", choice.save_cost_seconds),
            ("expected_lost_seconds", choice.expected_lost_seconds),
            ("storage_interval_steps", choice.storage_steps),
            ("persist_cost_seconds", choice.persist_cost_seconds),
        ):
            if value is not None:
                self._interval[name].labels(**self._labels).set(value)

    def spread(self, own_seconds: Optional[float], spread: Any) -> None:
        """This rank's pre-collective time; on rank 0 also how the slowest rank compares (a stragglers.Spread)."""
        if own_seconds is not None:
            self._own_seconds.labels(**self._labels).set(own_seconds)
        if spread is not None:
            self._slowest["slowest_rank_ratio"].labels(**self._labels).set(spread.ratio)
            self._slowest["slowest_rank"].labels(**self._labels).set(spread.slowest_rank)

    def nonfinite_step(self) -> None:
        self._nonfinite.inc()

    def rollback(self) -> None:
        self._rollbacks.inc()

    def evaluation(self, step: int, results: dict[str, float]) -> None:
        for name, value in {**results, "eval_step": float(step)}.items():
            if name in self._eval:
                self._eval[name].labels(**self._labels).set(value)

    def close(self) -> None:
        if self._gpu:
            self._gpu.stop()


def for_rank(context: Any, device_type: str) -> NullMetrics:
    """This rank's metrics when the launcher serves them (PROMETHEUS_MULTIPROC_DIR), else NullMetrics."""
    if not os.environ.get(MULTIPROC_DIR):
        return NullMetrics()
    gpu_index = context.local_rank if device_type == "cuda" and nvml_available() else None
    intensity = os.environ.get(contract.GRID_INTENSITY)
    return TrainerMetrics(
        context.name,
        context.namespace,
        context.rank,
        gpu_index,
        float(intensity) if intensity else None,
        attempt=context.attempt,
        group_restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        world_size=context.world_size,
    )


# ---------------------------------------------------------------- the launcher's endpoint


def serve(port: int, directory: str) -> Any:
    """Serve every rank's series from `directory` on `port` (in the launcher process); returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    class LiveRanksCollector(MultiProcessCollector):
        """Gauges of workers that died (killed, restarted in place) are dropped; their counters stay summed."""

        def collect(self):  # type: ignore[override]
            for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
                pid = int(os.path.basename(path).rsplit("_", 1)[1].split(".")[0])
                if not _alive(pid):
                    try:
                        os.remove(path)
                    except FileNotFoundError:
                        pass
            return super().collect()

    registry = CollectorRegistry()
    LiveRanksCollector(registry, path=directory)
    server, _thread = start_http_server(port, registry=registry)
    return server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the agent) is as good as dead for its gauges.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
