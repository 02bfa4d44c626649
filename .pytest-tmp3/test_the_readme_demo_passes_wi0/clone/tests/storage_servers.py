"""Real object-storage servers for tests: the GCS emulator and moto's S3 server.

Use the fixtures by importing them into a test module (``from storage_servers import gcs_server,
gcs_bucket  # noqa: F401``) or with ``pytest_plugins = ["storage_servers"]`` in tests/conftest.py.
Not from a second conftest.py: without __init__.py files pytest imports every conftest as the
module ``conftest``, and a sub-directory's one shadows tests/conftest.py for ``from conftest
import ...``.

- ``gcs_server`` / ``s3_server`` (session): start ``gcp-storage-emulator start --in-memory`` or
  ``moto_server`` from the Python environment running the tests, on a free port of 127.0.0.1,
  wait (bounded) until the port accepts connections, and stop the process at the end. They yield
  a :class:`StorageServer`: the endpoint URL, a ready fsspec filesystem, and the keyword
  arguments a ``CheckpointStore`` needs (``store_kwargs``).
- ``gcs_bucket`` / ``s3_bucket`` (function): create a new empty bucket per test and yield
  ``"gs://<bucket>"`` / ``"s3://<bucket>"``.

Everything here follows tests/../shared TESTING.md: gcsfs needs GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT
set to false before it is imported, and s3fs must not get region_name us-east-1 for moto.
"""

from __future__ import annotations

import os

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported anywhere

import contextlib
import itertools
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

__all__ = ["StorageServer", "gcs_server", "s3_server", "gcs_bucket", "s3_bucket", "gcs_move_is_copy"]

STARTUP_DEADLINE_S = 60.0
_bucket_ids = itertools.count()


@dataclass
class StorageServer:
    """A running storage server: ``scheme`` (gs or s3), ``endpoint_url``, ``fs`` (an fsspec
    filesystem talking to it) and ``store_kwargs`` (endpoint_url and storage_options for a
    CheckpointStore or ``verify``)."""

    scheme: str
    endpoint_url: str
    fs: Any
    store_kwargs: dict = field(default_factory=dict)
    process: Any = None

    def new_bucket(self) -> str:
        """Create an empty bucket with a unique name and return its name."""
        name = f"test-{next(_bucket_ids)}-{uuid.uuid4().hex[:8]}"
        self.fs.mkdir(name)
        self.fs.invalidate_cache()
        return name


def _bin(name: str) -> str:
    """The console script of this Python environment (not whatever is first on PATH)."""
    candidate = Path(sys.executable).parent / name  # no resolve(): a venv's python is a symlink
    if not candidate.exists():
        raise RuntimeError(f"{candidate} not found: install the project's dev extras into this environment")
    return str(candidate)


def gcs_emulator_command(port: int) -> list[str]:
    """gcp-storage-emulator in memory on 127.0.0.1:`port`, listening with a backlog of 128 connections instead of
    socketserver's 5. Its single-threaded HTTPServer otherwise drops the connection attempts beyond 5 while it
    serves one request, and each dropped one costs the client the kernel's 1 s SYN retry: 16 concurrent range reads
    took 1.1 s instead of 0.04 s. A cloud bucket has no such limit."""
    start = (
        "import socketserver, sys; socketserver.TCPServer.request_queue_size = 128; "
        "from gcp_storage_emulator.__main__ import main; sys.exit(main())"
    )
    _bin("gcp-storage-emulator")  # says how to install it when it is missing
    return [sys.executable, "-c", start, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(
    argv: list[str], port: int, name: str, host: str = "127.0.0.1", env: Optional[dict[str, str]] = None
) -> tuple[subprocess.Popen, Any]:
    """Start a server (`env` added to this process's environment) and poll its port until it accepts a connection,
    within a deadline."""
    log = tempfile.TemporaryFile(prefix=f"{name}-")
    process = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
    )
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log.read().decode(errors='replace')}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return process, log
        except OSError:
            pass
        if time.monotonic() > deadline:
            _stop(process)
            log.seek(0)
            raise RuntimeError(
                f"{name} did not open port {port} within {STARTUP_DEADLINE_S:.0f} s:\n"
                f"{log.read().decode(errors='replace')}"
            )
        time.sleep(0.05)  # poll interval, not a wait for readiness


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[StorageServer]:
    """gcp-storage-emulator, in memory, for the whole session."""
    with gcs_emulator() as server:
        yield server


@contextlib.contextmanager
def gcs_emulator() -> Iterator[StorageServer]:
    """gcp-storage-emulator, in memory, on a free port of 127.0.0.1."""
    import gcsfs

    if gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        raise RuntimeError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set; its "
            "experimental filesystem hangs about a minute per bucket on the emulator"
        )
    port = _free_port()
    process, log = _start(gcs_emulator_command(port), port, "gcp-storage-emulator")
    endpoint = f"http://127.0.0.1:{port}"
    options = {"token": "anon", "project": "test"}
    try:
        fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, **options)
        yield StorageServer("gs", endpoint, fs, {"endpoint_url": endpoint, "storage_options": options}, process)
    finally:
        _stop(process)
        log.close()


@contextlib.contextmanager
def moto_s3(host: str = "127.0.0.1") -> Iterator[StorageServer]:
    """moto's S3 server on `host` (credentials are moto's dummies); the end-to-end tier binds it to the
    node's address so pods reach it."""
    import s3fs

    port = _free_port()
    process, log = _start([_bin("moto_server"), "-H", host, "-p", str(port)], port, "moto_server", host)
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": "testing"}
    try:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, **options)
        yield StorageServer("s3", endpoint, fs, {"endpoint_url": endpoint, "storage_options": options}, process)
    finally:
        _stop(process)
        log.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[StorageServer]:
    """moto's S3 server for the whole session."""
    with moto_s3() as server:
        yield server


@pytest.fixture
def gcs_move_is_copy(monkeypatch) -> None:
    """Make gcsfs's move a plain copy + delete, for the emulator only.

    gcsfs moves an object with the GCS ``moveTo`` call; gcp-storage-emulator answers it with 501,
    which gcsfs retries 6 times (about 33 s) before it falls back to copy + delete. DCP's writer
    commits ``.metadata`` by renaming ``.metadata.tmp``, so every save would pay that. Real GCS
    implements moveTo, so this changes nothing but the emulator's missing endpoint. Patched on the
    class because fsspec caches filesystem instances (and per thread for some implementations).
    """
    import gcsfs
    from fsspec.asyn import AsyncFileSystem

    monkeypatch.setattr(gcsfs.GCSFileSystem, "_mv_file", AsyncFileSystem._mv_file)


@pytest.fixture
def gcs_bucket(gcs_server: StorageServer, gcs_move_is_copy) -> str:
    """A fresh bucket on the GCS emulator, as ``gs://<bucket>`` (moves are copy + delete)."""
    return f"gs://{gcs_server.new_bucket()}"


@pytest.fixture
def s3_bucket(s3_server: StorageServer) -> str:
    """A fresh bucket on moto's S3 server, as ``s3://<bucket>``."""
    return f"s3://{s3_server.new_bucket()}"
