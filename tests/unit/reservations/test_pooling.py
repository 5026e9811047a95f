"""Is a database transaction pooled (reservations.pooling)? The start-up probe through a real
PgBouncer (scripts/pgbouncer.py) and directly, its refusals naming what to set, ``manage.py check``,
workers and beat refusing an undeclared pooler, and the session locks on the direct connection.
The settings: config/test_env.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from reservations import pooling
from reservations.db import psycopg_params
from tests.support import ROOT
from tests.support.child_python import run_python
from tests.support.missing_tools import skip_for_missing

# --- a real PgBouncer ----------------------------------------------------------------------


def _start_pgbouncer(where: Path, pool_size: int) -> str:
    started = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "pgbouncer.py"),
            "start",
            str(where),
            str(pool_size),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DATABASE_URL": _direct_url()},
    )
    if started.returncode == 3:
        skip_for_missing("pgbouncer", started.stderr.strip())
    assert started.returncode == 0, started.stderr
    return started.stdout.strip().split("=", 1)[1].strip("'")  # 127.0.0.1:PORT


def _direct_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture(scope="module")
def pgbouncers() -> Iterator[dict[int, str]]:
    """Two private PgBouncers in transaction pooling: host:port by pool size (4 and 1). Their
    directories are straight under the system's temporary directory: as root, PgBouncer runs
    as another user (scripts/pgbouncer.py), who cannot enter pytest's own (root-only) ones."""
    started: dict[int, str] = {}
    dirs: list[Path] = []
    try:
        for size in (4, 1):
            dirs.append(Path(tempfile.mkdtemp(prefix=f"pgbouncer{size}-")))
            started[size] = _start_pgbouncer(dirs[-1], size)
        yield started
    finally:
        for where in dirs:
            subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "pgbouncer.py"), "stop", str(where)],
                check=False,
            )
            shutil.rmtree(where, ignore_errors=True)


def _through(address: str) -> dict[str, Any]:
    host, _, port = address.partition(":")
    return {**settings.DATABASES["default"], "HOST": host, "PORT": port}


def test_the_probe_finds_transaction_pooling_through_pgbouncer_and_a_session_directly(
    pgbouncers: dict[int, str],
) -> None:
    assert pooling.probe(psycopg_params(settings.DATABASES["default"])) == pooling.SESSION
    assert pooling.probe(psycopg_params(_through(pgbouncers[4]))) == pooling.TRANSACTION
    # One server connection: A's second question waits for B's transaction; it counts as pooled.
    assert pooling.probe(psycopg_params(_through(pgbouncers[1])), wait_s=0.5) == pooling.TRANSACTION


def test_the_refusals_name_what_to_set(pgbouncers: dict[int, str]) -> None:
    direct = settings.DATABASES["default"]
    pooled = _through(pgbouncers[4])
    assert pooling.refusals("none", direct, None) == []
    assert pooling.refusals("transaction", pooled, direct) == []
    [undeclared] = pooling.refusals("none", pooled, None)
    assert "DATABASE_POOLING=transaction" in undeclared and "DATABASE_DIRECT_URL" in undeclared
    [pooled_direct] = pooling.refusals("transaction", pooled, pooled)
    assert pooled_direct.startswith("DATABASE_DIRECT_URL goes through a transaction pooler")
    # A database that cannot be reached is not probed: the process starts and reports it later.
    assert pooling.refusals("none", {**direct, "HOST": "127.0.0.1", "PORT": "9"}, None) == []


def _pooled_env(address: str, **extra: str) -> dict[str, str]:
    db = settings.DATABASES["default"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATABASE_")}
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings.test",
            "DATABASE_URL": f"postgres://{db['USER']}@{address}/{db['NAME']}",
        }
    )
    env.update(extra)
    return env


@pytest.mark.django_db
def test_manage_py_check_refuses_an_undeclared_transaction_pooler(
    pgbouncers: dict[int, str],
) -> None:
    check = [sys.executable, "manage.py", "check", "--database", "default"]
    refused = subprocess.run(
        check, cwd=ROOT, env=_pooled_env(pgbouncers[4]), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0
    assert "reservations.E001" in refused.stderr and "DATABASE_POOLING" in refused.stderr
    declared = subprocess.run(
        check,
        cwd=ROOT,
        env=_pooled_env(
            pgbouncers[4], DATABASE_POOLING="transaction", DATABASE_DIRECT_URL=_direct_url()
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert declared.returncode == 0, declared.stderr


HOLD_A_SHARD_LOCK = """
import json
import django
django.setup()
from django.db import connection, connections
from cleanup.release import locks
from reservations.db import scalar, session_alias

key = locks.sweep_shard(0, 1)
taken = locks.try_lock(key)
session_pid = scalar("SELECT pg_backend_pid()", using=session_alias())
# Transactions on the pooled default connection between taking the lock and looking at it.
default_pids = {scalar("SELECT pg_backend_pid()") for _ in range(20)}
held = scalar(
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND classid = %s AND objid = %s AND objsubid = 2 AND pid = %s",
    [key[0], key[1], session_pid],
)
locks.unlock(key)
print(json.dumps({
    "alias": session_alias(),
    "taken": taken,
    "held": held,
    "session_port": connections[session_alias()].settings_dict["PORT"],
    "default_port": connection.settings_dict["PORT"],
    "session_pid_in_default_pids": session_pid in default_pids,
}))
"""


@pytest.mark.django_db(transaction=True)
def test_session_locks_live_on_the_direct_connection_behind_a_transaction_pooler(
    pgbouncers: dict[int, str],
) -> None:
    address = pgbouncers[4]
    env = _pooled_env(address, DATABASE_POOLING="transaction", DATABASE_DIRECT_URL=_direct_url())
    child = run_python(HOLD_A_SHARD_LOCK, env)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen["alias"] == "locks"
    assert seen["default_port"] == address.partition(":")[2]
    assert seen["session_port"] == str(settings.DATABASES["default"]["PORT"] or 5432)
    assert seen["taken"] is True
    assert seen["held"] == 1  # still held by the direct session after 20 pooled transactions
    assert seen["session_pid_in_default_pids"] is False


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", [["worker", "--pool", "solo"], ["beat"]])
def test_a_worker_and_beat_refuse_to_start_behind_an_undeclared_transaction_pooler(
    pgbouncers: dict[int, str], command: list[str]
) -> None:
    env = _pooled_env(pgbouncers[4], CELERY_BROKER_URL=settings.CELERY_BROKER_URL)
    started = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "config", *command, "--loglevel", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 1
    assert "refusing to start: DATABASE_URL reaches PostgreSQL through a transaction pooler" in (
        started.stderr
    )
    assert "set DATABASE_POOLING=transaction" in started.stderr
