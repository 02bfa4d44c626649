"""Rank 0 reports progress and committed checkpoints by patching its TrainingRun's status.

Best effort by design: reports go through a background thread at a bounded rate (the newest value
wins), so a slow or unreachable API server never stalls a training step, and a failure is logged
once, not every step. Outside a cluster (no service-account token) the reporter does nothing.
Only the standard library is used: the trainer image needs no Kubernetes client.
"""
from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("trainingrun.reporting")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ApiEndpoint:
    """Where and how to reach the API server."""

    base_url: str
    token: str
    ca_file: Optional[str]

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> Optional["ApiEndpoint"]:
        """TRAININGRUN_STATUS_URL (set by `trainingrun local`, which serves the status API itself),
        else the in-cluster API server, else None."""
        env = os.environ if env is None else env
        local = env.get("TRAININGRUN_STATUS_URL")
        if local:
            return cls(local.rstrip("/"), env.get("TRAININGRUN_STATUS_TOKEN", ""), None)
        return cls.in_cluster(env)

    @classmethod
    def in_cluster(cls, env: Optional[dict] = None, account_dir: str = SERVICE_ACCOUNT_DIR) -> Optional["ApiEndpoint"]:
        env = os.environ if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        token_path = os.path.join(account_dir, "token")
        if not host or not os.path.exists(token_path):
            return None
        with open(token_path, encoding="utf-8") as f:
            token = f.read().strip()
        ca = os.path.join(account_dir, "ca.crt")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token, ca if os.path.exists(ca) else None)


class StatusReporter:
    """Merge-patches `status` of one TrainingRun; `report()` never blocks and never raises."""

    def __init__(
        self,
        endpoint: Optional[ApiEndpoint],
        namespace: str,
        name: str,
        min_interval_seconds: float = 10.0,
        timeout_seconds: float = 10.0,
    ):
        self.endpoint = endpoint
        self.url = (
            f"{endpoint.base_url}/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns/{name}/status"
            if endpoint
            else ""
        )
        self.min_interval = min_interval_seconds
        self.timeout = timeout_seconds
        self.failures = 0
        self.sent = 0
        self._pending: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._thread: Optional[threading.Thread] = None
        if endpoint:
            self._thread = threading.Thread(target=self._run, name="status-reporter", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def report(self, **status: Any) -> None:
        """Queue fields of `status` (camelCase, as in the CRD); later values replace earlier ones."""
        if not self.enabled:
            return
        with self._lock:
            for key, value in status.items():
                if isinstance(value, dict) and isinstance(self._pending.get(key), dict):
                    self._pending[key].update(value)
                else:
                    self._pending[key] = value
        self._wake.set()

    def close(self, flush_timeout: float = 5.0) -> None:
        """Send what is queued (bounded by flush_timeout) and stop the thread."""
        if not self._thread:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(flush_timeout)

    def _run(self) -> None:
        last_sent = 0.0
        while True:
            self._wake.wait()
            if not self._stop.is_set():
                # Rate limit: wait out the interval unless we are asked to stop.
                self._stop.wait(max(0.0, last_sent + self.min_interval - time.monotonic()))
            with self._lock:
                body, self._pending = self._pending, {}
                self._wake.clear()
            if body:
                self._send(body)
                last_sent = time.monotonic()
            if self._stop.is_set():
                return

    def _send(self, status: dict[str, Any]) -> None:
        assert self.endpoint is not None
        request = urllib.request.Request(
            self.url,
            data=json.dumps({"status": status}).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.endpoint.token}",
                "Content-Type": "application/merge-patch+json",
                "Accept": "application/json",
            },
        )
        context = None
        if self.url.startswith("https://"):
            context = ssl.create_default_context(cafile=self.endpoint.ca_file)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as response:
                response.read()
            self.sent += 1
            if self._failing:
                log.info("status reporting works again")
            self._failing = False
        except Exception as error:  # noqa: BLE001 - reporting must never stop training
            self.failures += 1
            if not self._failing:
                # The URL and error only; the token is never part of a message.
                log.warning("cannot report status to %s (%s); training continues, will keep trying",
                            self.url, getattr(error, "reason", None) or type(error).__name__)
            self._failing = True
