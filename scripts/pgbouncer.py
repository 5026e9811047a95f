#!/usr/bin/env python3
"""A private PgBouncer in transaction pooling for noxfile.py's pgbouncer session and the
pooling tests: ``start DIR`` / ``stop DIR``.

``start`` writes an ini and an auth file in DIR (never anywhere else) and starts Debian's
``pgbouncer`` on a free port of 127.0.0.1 in front of the PostgreSQL server that
``DATABASE_URL`` names (every database name passes through, trust authentication for its
user), with ``pool_mode = transaction`` and a small pool, waits until it answers, and prints
the line to ``eval``:

    export RESERVATIONS_TEST_PGBOUNCER='127.0.0.1:PORT'

tests/support/fleet.py then sends the worker and beat processes through it
(``DATABASE_POOLING=transaction``, with ``DATABASE_DIRECT_URL`` direct). It never touches the
machine's own pgbouncer service. ``stop`` ends the one started in DIR. Exit 3 with the reason
on stderr when pgbouncer is missing or does not start.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

SKIP = 3
# PgBouncer refuses to run as root; as root it is started as this user (Debian's own).
UNPRIVILEGED = "postgres"
# Server connections per database and user: small, so the tests see connections reused across
# clients, and a pool of one or two is what the start-up probe must handle.
POOL_SIZE = 4


def log(message: str) -> None:
    print(f"pgbouncer: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def server_of(url: str) -> tuple[str, str, str]:
    """Host (or socket directory, ``?host=/path``), port and user of the PostgreSQL server
    ``url`` names (one host)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    userinfo, _, hostport = parts.netloc.rpartition("@")
    host, _, port = hostport.partition(":")
    host = query.get("host") or host or "127.0.0.1"
    port = port or query.get("port") or "5432"
    return host, port, unquote(userinfo.partition(":")[0]) or "postgres"


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )


def start(where: Path, pool_size: int = POOL_SIZE) -> int:
    binary = pgbouncer_binary()
    if binary is None:
        log("pgbouncer is not installed")
        return SKIP
    host, server_port, user = server_of(os.environ.get("DATABASE_URL", ""))
    where.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (where / "users.txt").write_text(f'"{user}" ""\n')
    (where / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={server_port}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {where / 'users.txt'}\n"
        f"admin_users = {user}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 200\n"
        # Django and psycopg send these at connect; PgBouncer refuses unknown startup options.
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {where / 'pgbouncer.log'}\n"
        f"pidfile = {where / 'pgbouncer.pid'}\n"
    )
    command = [binary, "-d"]
    if os.geteuid() == 0:
        shutil.chown(where, UNPRIVILEGED)
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(where / name, UNPRIVILEGED)
        command += ["-u", UNPRIVILEGED]
    result = subprocess.run(
        [*command, str(where / "pgbouncer.ini")], capture_output=True, text=True
    )
    if result.returncode != 0:
        log(f"pgbouncer refused to start: {(result.stderr or result.stdout)[-300:]}")
        return SKIP
    deadline = time.monotonic() + 15
    while not answers(port):
        if time.monotonic() > deadline:
            logfile = where / "pgbouncer.log"
            log(f"no answer on port {port}; its log: {logfile.read_text()[-300:]}")
            stop(where)
            return SKIP
        time.sleep(0.1)
    log(f"PgBouncer (transaction pooling) on 127.0.0.1:{port}, in front of {host}:{server_port}")
    print(f"export RESERVATIONS_TEST_PGBOUNCER='127.0.0.1:{port}'")
    return 0


def stop(where: Path) -> int:
    pidfile = where / "pgbouncer.pid"
    if pidfile.exists():
        subprocess.run(["kill", pidfile.read_text().strip()], check=False)
    return 0


def main() -> int:
    args = sys.argv[1:]
    if not (
        (len(args) == 2 and args[0] in {"start", "stop"})
        or (len(args) == 3 and args[0] == "start" and args[2].isdigit())
    ):
        print("usage: pgbouncer.py start DIR [POOL_SIZE] | stop DIR", file=sys.stderr)
        return 2
    where = Path(args[1]).resolve()
    if args[0] == "stop":
        return stop(where)
    return start(where, int(args[2]) if len(args) == 3 else POOL_SIZE)


if __name__ == "__main__":
    sys.exit(main())
