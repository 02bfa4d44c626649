"""A real MLflow tracking server on loopback, for the trainer's MLflow logger (tests/integration)."""

from __future__ import annotations

import tempfile
from typing import Iterator

import pytest

from storage_servers import _bin, _free_port, _start, _stop


@pytest.fixture(scope="session")
def mlflow_server() -> Iterator[str]:
    """`mlflow server` on a SQLite store in a temporary directory; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="mlflow-") as store:
        port = _free_port()
        process, log = _start(
            [
                _bin("mlflow"),
                "server",
                "--backend-store-uri",
                f"sqlite:///{store}/mlflow.db",
                "--default-artifact-root",
                f"{store}/artifacts",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            port,
            "mlflow-server",
            # Its job runner (not used here) keeps its queue in a folder of /dev/shm it never removes.
            env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            _stop(process)
            log.close()
