"""CPU of the report endpoint's side of one TLS handshake, by the key its certificate has.

Every report of a trainer is a new HTTPS connection (the trainer's urllib keeps none), so the endpoint makes one
handshake per report: with 2,000 runs reporting every 10 s, 200 a second. The chart made its certificate with
genCA/genSignedCert (RSA 2048) and now makes it with ECDSA P-256 keys. This script makes a CA and a certificate of
each kind (test_reports_real.certificate), serves them with the operator's own server context (reports.server_ssl_context), and
completes --handshakes handshakes over loopback with a client that verifies the chain as the trainer does; the
figure is the server thread's CPU per handshake (time.thread_time, so a loaded machine changes it little).

    python benchmarks/report_tls.py [--handshakes 400]
Last line: `result: rsa2048_server_cpu_ms=<x> ecdsa_p256_server_cpu_ms=<x> ecdsa_vs_rsa=<x>`.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "common"), str(REPO / "operator"), str(REPO / "tests"), str(REPO / "tests" / "real_api")]

from test_reports_real import certificate  # noqa: E402

from trainingrun_operator.reports import server_ssl_context  # noqa: E402

HOST = "trainingrun-operator-report.trainingrun-system.svc"


def server_cpu_per_handshake(tls_dir: Path, handshakes: int) -> list[float]:
    """Seconds of the server thread's CPU for each handshake (accept excluded), clients verifying the chain."""
    server_context = server_ssl_context(str(tls_dir))
    client_context = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    costs: list[float] = []

    def serve() -> None:
        for _ in range(handshakes):
            connection, _ = listener.accept()
            began = time.thread_time()
            with server_context.wrap_socket(connection, server_side=True) as tls:
                costs.append(time.thread_time() - began)
                tls.recv(1)

    server = threading.Thread(target=serve)
    server.start()
    for _ in range(handshakes):
        with socket.create_connection(("127.0.0.1", port)) as raw:
            with client_context.wrap_socket(raw, server_hostname=HOST) as tls:
                tls.sendall(b"x")
    server.join(timeout=60)
    listener.close()
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handshakes", type=int, default=400, help="handshakes per key kind (default 400)")
    args = parser.parse_args(argv)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="report-tls-") as tmp:
        for kind in ("rsa", "ecdsa"):
            (Path(tmp) / kind).mkdir()
            costs = server_cpu_per_handshake(certificate(Path(tmp) / kind, HOST, kind), args.handshakes)
            figures[kind] = 1000 * statistics.median(costs)
            print(f"{kind:<6} {len(costs)} handshakes: server CPU per handshake, median {figures[kind]:.3f} ms")
    ratio = figures["ecdsa"] / figures["rsa"]
    print(
        f"result: rsa2048_server_cpu_ms={figures['rsa']:.3f} ecdsa_p256_server_cpu_ms={figures['ecdsa']:.3f} "
        f"ecdsa_vs_rsa={ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
