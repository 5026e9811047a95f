#!/usr/bin/env python3
"""Find (or, with CI=true, start) a RabbitMQ for noxfile.py's rabbitmq session (and the unit
tests of confirmed publishing) and print
``export CELERY_BROKER_URL=amqp://…/<the tests' own vhost>``.

- ``RESERVATIONS_TEST_AMQP_URL`` set: used as given (its vhost must be the tests' own: the
  tests purge their queues in it).
- Otherwise RabbitMQ on 127.0.0.1:5672 (guest/guest). With ``CI=true``, as root, and the Debian
  package installed but the server stopped, it is started (``service rabbitmq-server start``,
  else ``rabbitmq-server -detached``). The vhost ``RESERVATIONS_TEST_AMQP_VHOST`` (default
  ``reservations_test``) is created with ``rabbitmqctl`` if missing and guest is given rights
  on it. Nothing else is created, changed or deleted; the vhost is left for the next run.

Exit 0 with the export line on stdout; exit 3 with the reason on stderr when no RabbitMQ can
be had (the phase is then skipped and says why). Human-readable lines go to stderr.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from urllib.parse import quote

HOST, PORT = "127.0.0.1", 5672
SKIP = 3


def log(message: str) -> None:
    print(f"rabbitmq: {message}", file=sys.stderr, flush=True)


def reachable(timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((HOST, PORT), timeout=timeout):
            return True
    except OSError:
        return False


def wait_reachable(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if reachable():
            return True
        time.sleep(0.5)
    return reachable()


def start_server() -> bool:
    server = shutil.which("rabbitmq-server") or (
        "/usr/sbin/rabbitmq-server" if os.path.exists("/usr/sbin/rabbitmq-server") else None
    )
    if not server:
        log("rabbitmq-server is not installed")
        return False
    if os.environ.get("CI", "").lower() not in {"1", "true", "yes"} or os.geteuid() != 0:
        log("RabbitMQ is installed but stopped (it is started only with CI=true, as root)")
        return False
    service = shutil.which("service")
    if service:
        log("CI: starting the machine's RabbitMQ: service rabbitmq-server start")
        subprocess.run([service, "rabbitmq-server", "start"], stdout=sys.stderr,
                       stderr=sys.stderr, check=False, timeout=120)  # fmt: skip
        if wait_reachable(60):
            return True
    log(f"CI: starting the machine's RabbitMQ: {server} -detached")
    subprocess.run([server, "-detached"], stdout=sys.stderr, stderr=sys.stderr, check=False)
    return wait_reachable(90)


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )


def ensure_vhost(vhost: str) -> str | None:
    """Create the vhost if missing, give guest rights on it; None or the reason it failed."""
    if not shutil.which("rabbitmqctl"):
        return "rabbitmqctl is not available to create the tests' own vhost"
    listed = ctl("list_vhosts", "name")
    if listed.returncode != 0:
        return f"rabbitmqctl list_vhosts failed: {listed.stderr.strip()[:200]}"
    if vhost not in listed.stdout.split():
        added = ctl("add_vhost", vhost)
        if added.returncode != 0 and "already" not in added.stderr:
            return f"rabbitmqctl add_vhost {vhost} failed: {added.stderr.strip()[:200]}"
        log(f"created vhost {vhost}")
    perms = ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    if perms.returncode != 0:
        return f"rabbitmqctl set_permissions failed: {perms.stderr.strip()[:200]}"
    return None


def can_connect(url: str) -> str | None:
    try:
        from kombu import Connection

        with Connection(url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=3)
        return None
    except Exception as exc:  # noqa: BLE001 - the reason is printed
        return f"cannot connect to {url.split('@')[-1]}: {exc!r}"[:300]


def main() -> int:
    url = os.environ.get("RESERVATIONS_TEST_AMQP_URL", "").strip()
    if not url:
        if not reachable() and not start_server():
            log(f"SKIP: no RabbitMQ on {HOST}:{PORT} and none could be started")
            return SKIP
        vhost = os.environ.get("RESERVATIONS_TEST_AMQP_VHOST", "reservations_test")
        reason = ensure_vhost(vhost)
        if reason:
            log(f"SKIP: {reason}")
            return SKIP
        url = f"amqp://guest:guest@{HOST}:{PORT}/{quote(vhost, safe='')}"
    reason = can_connect(url)
    if reason:
        log(f"SKIP: {reason}")
        return SKIP
    log(f"using {url.split('@')[-1]}")
    print(f"export CELERY_BROKER_URL={url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
