"""Experiment trackers: what rank 0 logs to the loggers of `spec.trainer.loggers`.

A slow or unreachable tracker must never cost a step: the training thread only puts records on a bounded queue
(`QUEUE_MAX`), and one background thread hands them to each tracker. A full queue drops the record (counted in
`dropped`, one warning); a tracker that raises is logged once and still gets the later records (it may recover).
`close()` waits a bounded time (`CLOSE_SECONDS`), so a hung tracker cannot hold the process at exit either.

One tracked run per TrainingRun, whatever the attempts and restarts, and each step once (a resumed run computes
the steps after its checkpoint again, and with exact resume the same values):

- TensorBoard: the event files under `logDir` are reopened with `purge_step` at the first step after the checkpoint
  the run resumed from, so TensorBoard's readers drop what an earlier attempt logged from there on.
- MLflow: the run is found by its tag `trainingrun.uid` (the TrainingRun's uid), or created under the experiment;
  steps up to the last one the run already holds are not sent again (MLflow keeps every value sent).
- W&B: the run's id is the TrainingRun's uid and every attempt resumes it. Steps up to the last one it holds are not
  sent again: W&B says which online; offline (WANDB_MODE=offline) each process writes a directory of its own for
  the same id (W&B's design: `wandb sync` puts them in one run), and the steps the earlier ones hold are read from
  their transaction logs.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import queue
import re
import struct
import tempfile
import threading
import time
import zlib
from typing import Any, Iterator, Mapping, Optional, Sequence

from trainingrun_api.logger_config import LoggerConfig

from .background import give_way_to_training

log = logging.getLogger("trainingrun.tracking")

QUEUE_MAX = 1024
CLOSE_SECONDS = 10.0
_STOP = object()
#: Words of a config key (camelCase, snake_case or kebab-case) whose value is never sent to a tracker: initArgs of a
#: user's class may hold a key or a token. Whole words: `tokenizer_path` is no token.
SECRET_WORDS = {
    "secret",
    "secrets",
    "token",
    "password",
    "passwd",
    "pwd",
    "credential",
    "credentials",
    "auth",
    "authorization",
    "signature",
    "apikey",
    "privatekey",
}
SECRET_PAIRS = {("api", "key"), ("private", "key"), ("access", "key")}
#: The user:password@ of a URI.
USERINFO = re.compile(r"(?<=://)[^/@\s]*@")
#: A URI's query and fragment (from the first ? or #), and each parameter's value in them.
QUERY = re.compile(r"(?<=://)([^?#\s]*)([?#]\S*)")
PARAMETER_VALUE = re.compile(r"(?<=[?&;#])([^=&;#\s]*)=[^&;#\s]*")
REDACTED = "<redacted>"


def _redacted_text(text: str) -> str:
    """`text` with each URI's userinfo and every value of its query and fragment replaced (`?token=`, signed URLs'
    `X-Amz-Signature=`): which parameters are secrets is the server's to say, so none is passed on."""
    text = USERINFO.sub(REDACTED + "@", text)
    return QUERY.sub(lambda found: found[1] + PARAMETER_VALUE.sub(rf"\1={REDACTED}", found[2]), text)


def secret_key(key: Any) -> bool:
    """Whether a config key names a secret (by its words, see SECRET_WORDS)."""
    if not isinstance(key, str):
        return False
    words = [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", key)]
    return any(word in SECRET_WORDS for word in words) or any(pair in SECRET_PAIRS for pair in zip(words, words[1:]))


def redacted(config: Any) -> Any:
    """The config as trackers get it: values of secret-looking keys replaced, and userinfo and query values cut out of URIs
    (validation refuses both in the fields it knows; this also covers a user's initArgs and older specs)."""
    if isinstance(config, Mapping):
        return {
            key: REDACTED if secret_key(key) and value not in (None, "") else redacted(value)
            for key, value in config.items()
        }
    if isinstance(config, (list, tuple)):
        return [redacted(value) for value in config]
    if isinstance(config, str):
        return _redacted_text(config)
    return config


class TensorBoard:
    """Scalars and the config as text, to event files under `log_dir` (torch's SummaryWriter)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.writer: Any = None

    @staticmethod
    def load() -> None:
        import torch.utils.tensorboard  # noqa: F401

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # Events an earlier attempt logged after this run's checkpoint are hidden from here on: no step twice.
        self.writer = SummaryWriter(self.log_dir, purge_step=step + 1 if step else None)
        self.writer.add_text("config", f"```json\n{json.dumps(config, indent=1, sort_keys=True)}\n```", step)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, finished: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()


class MLflow:
    """Metrics, the config as parameters, and the run's end, on an MLflow tracking server."""

    UID_TAG = "trainingrun.uid"
    #: MLflow's own limits: parameters per request, and the length of a parameter's value.
    PARAMS_PER_BATCH, PARAM_CHARS = 100, 6000

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_uid: str, namespace: str):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.run_uid, self.namespace = run_uid, namespace
        self.client: Any = None
        self.run_id = ""
        self.logged_up_to = -1  #: the last step the run already holds

    @staticmethod
    def load() -> None:
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{self.UID_TAG}` = '{self.run_uid}'", max_results=1
        )
        if runs:
            self.run_id = runs[0].info.run_id
            history = self.client.get_metric_history(self.run_id, "train/loss")
            self.logged_up_to = max((m.step for m in history), default=-1)
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(
            experiment_id,
            run_name=self.run_name,
            tags={self.UID_TAG: self.run_uid, "trainingrun.namespace": self.namespace},
        )
        self.run_id = run.info.run_id
        params = [Param(key, str(value)[: self.PARAM_CHARS]) for key, value in sorted(_flat(config).items())]
        for first in range(0, len(params), self.PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + self.PARAMS_PER_BATCH])

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_up_to:
            return  # the run holds this step already, from the attempt that was lost after it
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, now, step) for name, value in values.items()])

    def close(self, finished: bool = False) -> None:
        if self.client is not None and self.run_id and finished:
            self.client.set_terminated(self.run_id, "FINISHED")


class WandB:
    """Metrics and the config on Weights & Biases: one W&B run per TrainingRun, whose id is the run's uid."""

    def __init__(
        self, project: str, entity: Optional[str], directory: str, run_name: str, run_uid: str, namespace: str
    ):
        self.project, self.entity, self.run_name, self.namespace = project, entity, run_name, namespace
        self.directory = directory or tempfile.gettempdir()
        self.run_id = run_uid
        self.run: Any = None
        self.logged_up_to = -1  #: the last step the W&B run already holds

    @staticmethod
    def load() -> None:
        import wandb  # noqa: F401

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        import wandb

        os.makedirs(self.directory, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=self.run_id,
            name=self.run_name,
            resume="allow",
            dir=self.directory,
            config=dict(config),
            tags=[self.namespace],
            settings=wandb.Settings(console="off"),
        )
        if self.run.settings._offline:
            earlier = [
                p
                for p in glob.glob(
                    os.path.join(
                        self.run.settings.wandb_dir, f"offline-run-*-{self.run_id}", f"run-{self.run_id}.wandb"
                    )
                )
                if os.path.dirname(p) != self.run.settings.sync_dir
            ]
            self.logged_up_to = max((s for path in earlier for s in wandb_history_steps(path)), default=-1)
        elif self.run.resumed:
            self.logged_up_to = self.run.step - 1  # W&B's next step for this run

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        if step <= self.logged_up_to:
            return  # the run holds this step already, from the attempt that was lost after it
        self.run.log(dict(values), step=step)

    def close(self, finished: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if finished else 1)  # 1: the attempt ended early; the next one resumes it


#: W&B's transaction log: a 7-byte header (":W&B", 0xBEE1, version 0), then LevelDB's log format: 32 KiB blocks of
#: chunks, each a little-endian crc32 (over its type and data), length and type (1 whole, 2 first, 3 middle, 4 last).
WANDB_LOG_HEADER, WANDB_LOG_BLOCK, WANDB_CHUNK_HEADER = b":W&B\xe1\xbe\x00", 32768, 7


def wandb_history_steps(path: str) -> Iterator[int]:
    """The steps of the history records in a W&B transaction log (`run-<id>.wandb`), up to a torn or unknown tail:
    a killed process leaves its last block unwritten, and what it did not write is logged again."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as log_file:
        data = log_file.read()
    if not data.startswith(WANDB_LOG_HEADER):
        return
    position, pending = len(WANDB_LOG_HEADER), b""
    while position + WANDB_CHUNK_HEADER <= len(data):
        left_in_block = WANDB_LOG_BLOCK - position % WANDB_LOG_BLOCK
        if left_in_block < WANDB_CHUNK_HEADER:
            position += left_in_block  # a block's last bytes are padding
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        chunk = data[position + WANDB_CHUNK_HEADER : position + WANDB_CHUNK_HEADER + length]
        if len(chunk) < length or kind not in (1, 2, 3, 4) or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            return
        position += WANDB_CHUNK_HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated by protoc
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                yield record.history.step.num


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return flat


def backends_for(
    loggers: Sequence[LoggerConfig], run_name: str = "run", run_uid: str = "", namespace: str = "default"
) -> list[Any]:
    backends: list[Any] = []
    for logger in loggers:
        if logger.kind == "tensorboard":
            backends.append(TensorBoard(logger.log_dir or ""))
        elif logger.kind == "mlflow":
            backends.append(
                MLflow(
                    logger.tracking_uri or "", logger.experiment or namespace, run_name, run_uid or run_name, namespace
                )
            )
        elif logger.kind == "wandb":
            backends.append(
                WandB(
                    logger.project or "", logger.entity, logger.log_dir or "", run_name, run_uid or run_name, namespace
                )
            )
    return backends


class Tracker:
    """The training thread's side: `start`, `metrics`, `close` only queue records; `backends` get them in order."""

    def __init__(self, backends: Sequence[Any], queue_max: int = QUEUE_MAX):
        # The trackers' libraries are imported here, before the first step: an import holds the GIL for seconds
        # (mlflow's about 3 s of CPU), which on the delivery thread would slow the steps it overlaps.
        for backend in backends:
            getattr(backend, "load", lambda: None)()
        self.backends = list(backends)
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(queue_max)
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._deliver, name="trainingrun-tracking", daemon=True)
        self._thread.start()

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        self._put(("start", step, redacted(config)))

    def metrics(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        kept = {name: float(value) for name, value in values.items() if value is not None}
        if kept:
            self._put(("metrics", step, kept))

    def close(self, finished: bool = False, timeout: float = CLOSE_SECONDS) -> None:
        """`finished`: the run trained its last step (MLflow marks the run FINISHED; otherwise it stays RUNNING
        for the next attempt)."""
        deadline = time.monotonic() + timeout  # one budget for all of it: exits (a preemption's too) wait little
        self._put(("close", 0, finished), block_for=max(0.01, deadline - time.monotonic()))
        self._put(_STOP, block_for=max(0.01, deadline - time.monotonic()))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("a tracker did not finish within %.0f s; its last records may be missing", timeout)

    def _put(self, record: Any, block_for: float = 0.0) -> None:
        try:
            self._queue.put(record, timeout=block_for) if block_for else self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "the trackers fall behind (%d records queued): records are dropped, training goes on",
                    self._queue.maxsize,
                )

    def _deliver(self) -> None:
        give_way_to_training()  # woken by each step's records: it must not preempt the step that queued them
        while (record := self._queue.get()) is not _STOP:
            kind, step, payload = record
            for number, backend in enumerate(self.backends):
                try:
                    if kind == "close":
                        backend.close(payload)
                    else:
                        getattr(backend, kind)(step, payload)
                except Exception as error:  # noqa: BLE001 - a tracker's failure must not end training
                    if number not in self._failed:
                        self._failed.add(number)
                        log.warning(
                            "%s: %s failed (%s: %s); training goes on, later records are still sent",
                            type(backend).__name__,
                            kind,
                            type(error).__name__,
                            str(error).splitlines()[0] if str(error) else "",
                        )


class NullTracker:
    """Ranks other than 0, and runs without loggers."""

    dropped = 0

    def start(self, step: int, config: Mapping[str, Any]) -> None:
        pass

    def metrics(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        pass

    def close(self, finished: bool = False, timeout: float = CLOSE_SECONDS) -> None:
        pass


def for_rank(loggers: Sequence[LoggerConfig], context: Any) -> Any:
    """Rank 0's tracker for `context` (a RunContext: the run's name, uid and namespace), else a NullTracker."""
    backends = backends_for(loggers, context.name, context.uid, context.namespace) if context.rank == 0 else []
    return Tracker(backends) if backends else NullTracker()
