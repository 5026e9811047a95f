#!/usr/bin/env python3
"""A private TLS Redis for noxfile.py's tls session: ``start DIR`` / ``stop DIR``.

``start`` makes a throwaway certificate authority and a server certificate for ``localhost``
and 127.0.0.1 with ``openssl`` (in DIR, never anywhere else), starts Debian's ``redis-server``
(built with TLS) on a free port with TLS only (no plain port), waits until it answers over
TLS, and prints the line to ``eval``:

    export CELERY_BROKER_URL='rediss://localhost:PORT/0?ssl_cert_reqs=required&ssl_ca_certs=DIR/ca.pem'

so the suites connect with certificate and host-name checks on, as production requires. It
never touches the machine's own Redis. ``stop`` ends the server started in DIR. Exit 3 with the
reason on stderr when redis-server or openssl is missing, or redis-server has no TLS.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

SKIP = 3


def log(message: str) -> None:
    print(f"tls-redis: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(where: Path) -> None:
    """A CA, and a server certificate it signs for localhost and 127.0.0.1 (one day)."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=reservation-cleanup test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=where,
    )
    (where / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=where,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
        cwd=where,
    )


def answers_over_tls(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection(("localhost", port), timeout=1) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"PING\r\n")
                return tls.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start(where: Path) -> int:
    server = shutil.which("redis-server")
    if server is None or shutil.which("openssl") is None:
        log("redis-server or openssl is not installed")
        return SKIP
    where.mkdir(parents=True, exist_ok=True)
    make_certificates(where)
    port = free_port()
    command = [
        server,
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        str(where / "server.pem"),
        "--tls-key-file",
        str(where / "server.key"),
        "--tls-ca-cert-file",
        str(where / "ca.pem"),
        "--tls-auth-clients",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(where),
        "--daemonize",
        "yes",
        "--pidfile",
        str(where / "redis.pid"),
        "--logfile",
        str(where / "redis.log"),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        log(f"redis-server refused to start with TLS: {(result.stderr or result.stdout)[-300:]}")
        return SKIP
    deadline = time.monotonic() + 15
    while not answers_over_tls(port, where / "ca.pem"):
        if time.monotonic() > deadline:
            log(
                f"no TLS answer on port {port}; its log: {(where / 'redis.log').read_text()[-300:]}"
            )
            stop(where)
            return SKIP
        time.sleep(0.2)
    url = f"rediss://localhost:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={where / 'ca.pem'}"
    log(f"TLS Redis on port {port} (certificates in {where})")
    print(f"export CELERY_BROKER_URL='{url}'")
    return 0


def stop(where: Path) -> int:
    pidfile = where / "redis.pid"
    if pidfile.exists():
        subprocess.run(["kill", pidfile.read_text().strip()], check=False)
    return 0


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in {"start", "stop"}:
        print("usage: tls_redis.py start|stop DIR", file=sys.stderr)
        return 2
    where = Path(sys.argv[2]).resolve()
    return start(where) if sys.argv[1] == "start" else stop(where)


if __name__ == "__main__":
    sys.exit(main())
