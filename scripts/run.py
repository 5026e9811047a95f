"""Run the whole system in the foreground for local development: `make run`.

1. find or start PostgreSQL and Redis (scripts/backing_servers.py: configured URLs, else local
   servers, else embedded private servers under ./.embedded/);
2. migrate; create a dev superuser admin/admin when there is no superuser (local settings only);
   install the cleanup beat schedule when that management command exists;
3. start web (runserver), one Celery worker, Celery beat and Flower (read-only), each in its
   own process group, their output prefixed with their name; once web answers, print where
   everything is and the README's try-it story (scripts/tryit.py);
4. Ctrl-C (SIGINT) or SIGTERM stops them all (SIGTERM to each group, SIGKILL after a grace
   period), waits for them, then stops the embedded servers this run started, last.

Environment: PORT (web, 8000), FLOWER_PORT (5555), FLOWER_BASIC_AUTH (admin:admin for local
development), DJANGO_SETTINGS_MODULE (config.settings.local), plus everything settings read.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

import backing_servers
import tryit

ROOT = backing_servers.ROOT
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
CELERY = str(VENV_BIN / "celery")
HOST = "127.0.0.1"
GRACE_SECONDS = 20
DEV_SUPERUSER = ("admin", "admin")
DEFAULT_FLOWER_AUTH = "admin:admin"

_print_lock = threading.Lock()


def say(message: str) -> None:
    with _print_lock:
        print(f"run: {message}", flush=True)


class Shutdown(Exception):
    """Raised by the signal handler while we are still setting up."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    pump: threading.Thread


class Supervisor:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.children: list[Child] = []
        self.stopping = False
        self.signals = 0
        self.width = 6

    # --- signals ------------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals == 1:
            say(f"{signal.Signals(signum).name}: stopping everything (again to force)")
        else:
            say("forcing: SIGKILL to every process group")
            self.kill_all(signal.SIGKILL)
        if not self.stopping:
            self.stopping = True
            if not self.children:  # still setting up: unwind through the finally blocks
                raise Shutdown()

    # --- children -----------------------------------------------------------------------------
    def start(self, name: str, argv: list[str]) -> None:
        say(f"starting {name}: {' '.join(argv)}")
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: the terminal's Ctrl-C reaches only us
        )
        assert process.stdout is not None
        pump = threading.Thread(target=self._pump, args=(name, process.stdout), daemon=True)
        pump.start()
        self.children.append(Child(name, process, pump))

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        prefix = f"{name:<{self.width}} | "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with _print_lock:
                print(prefix + line, flush=True)
        stream.close()

    def kill_all(self, sig: int) -> None:
        for child in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.process.pid, sig)

    def group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop_all(self) -> None:
        if not self.children:
            return
        say("sending SIGTERM to web, worker, beat, flower")
        for child in self.children:
            # The Celery processes get it on their main process only (a worker's warm shutdown
            # then stops its own pool; SIGTERM to pool children would lose their tasks); the
            # runserver autoreloader's parent would leave its server child behind, so the whole
            # group gets it there.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if child.name == "web":
                    os.killpg(child.process.pid, signal.SIGTERM)
                else:
                    os.kill(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline:
            self.reap()
            if not any(self.group_alive(c.process.pid) for c in self.children):
                break
            time.sleep(0.2)
        else:
            say(f"still running after {GRACE_SECONDS}s: SIGKILL")
            self.kill_all(signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(10)
            child.pump.join(2)
            say(f"{child.name} exited ({child.process.returncode})")
        while any(self.group_alive(c.process.pid) for c in self.children):
            self.reap()
            time.sleep(0.1)

    def reap(self) -> None:
        """Reap our own children (poll) and then orphaned grandchildren: a zombie still counts
        as a member of its process group."""
        for child in self.children:
            child.process.poll()
        reap_orphans(self)

    def first_exited(self) -> Child | None:
        for child in self.children:
            if child.process.poll() is not None:
                return child
        return None


# --- orphans: be the subreaper so daemonised or orphaned grandchildren are reaped here ----------
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(supervisor: Supervisor | None) -> None:
    """Reap exited processes that are not one of our Popen children (those reap themselves)."""
    own = {c.process.pid for c in supervisor.children} if supervisor else set()
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in own:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


# --- setup steps --------------------------------------------------------------------------------
def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def manage(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "manage.py", *args], cwd=ROOT, env=env, check=check, text=True)


def manage_quiet(env: dict[str, str], *args: str) -> int:
    result = subprocess.run(
        [PYTHON, "manage.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return result.returncode


CREATE_SUPERUSER = """
from django.contrib.auth import get_user_model
User = get_user_model()
if User.objects.filter(is_superuser=True).exists():
    print("exists")
else:
    User.objects.create_superuser({user!r}, "admin@localhost", {password!r})
    print("created")
"""


def ensure_dev_superuser(env: dict[str, str]) -> str | None:
    """Create admin/admin when there is no superuser. Local settings only; returns what it did."""
    if not env["DJANGO_SETTINGS_MODULE"].endswith(".local"):
        return None
    user, password = DEV_SUPERUSER
    result = subprocess.run(
        [PYTHON, "manage.py", "shell", "-c", CREATE_SUPERUSER.format(user=user, password=password)],
        cwd=ROOT,
        env=env,
        check=True,
        text=True,
        stdout=subprocess.PIPE,
    )
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else None


def web_ready(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def banner(
    port: int,
    flower_port: int,
    flower_auth: str,
    superuser: str | None,
    svc: backing_servers.Services,
) -> str:
    base = f"http://{HOST}:{port}"
    user, password = DEV_SUPERUSER
    admin_note = f"  (dev superuser {user} / {password})" if superuser == "created" else ""
    if superuser == "exists":
        admin_note = "  (existing superuser; the dev default is admin / admin)"
    lines = [
        "",
        "Reservation cleanup is running. Ctrl-C stops everything.",
        f"  admin    {base}/admin/{admin_note}",
        f"  API      {base}/api/v1/ (OpenAPI: {base}/api/v1/openapi.json, staff: /api/v1/docs)",
        f"  metrics  {base}/metrics",
        f"  Flower   http://{HOST}:{flower_port}/  (basic auth {flower_auth})",
        f"  postgres {svc.sources.get('postgres', '?')}",
        f"  broker   {svc.sources.get('broker', '?')}",
        "",
        *try_it(port),
    ]
    return "\n".join(lines)


def try_it(port: int) -> list[str]:
    """The README's try-it story, to paste into a second terminal (scripts/tryit.py)."""
    try:
        story = tryit.read()
    except (OSError, ValueError) as exc:
        return [f"(README.md's try-it story is unavailable: {exc})", ""]
    head = 'Try it: paste into a second terminal at the checkout\'s root (README.md, "Try it"):'
    lines = [head, ""]
    if port != 8000:
        lines.append(f"export PORT={port}")
    return [*lines, *story, ""]


def flower_argv(port: int) -> list[str]:
    """Flower read-only: the workers refuse most control commands anyway, and a dashboard that
    offers shutdown and pool buttons invites someone to press them."""
    return [
        CELERY, "-A", "config", "flower", f"--address={HOST}", f"--port={port}",
        "--read_only=True", "--persistent=True", "--db=var/flower.db",
        "--max_tasks=10000",  # the last 10,000 tasks in memory, not Flower's default 100,000
    ]  # fmt: skip


def main() -> int:
    os.chdir(ROOT)
    become_subreaper()
    port = int(os.environ.get("PORT", "8000"))
    flower_port = int(os.environ.get("FLOWER_PORT", "5555"))
    for name, value in (("PORT", port), ("FLOWER_PORT", flower_port)):
        if not port_free(value):
            say(f"error: {HOST}:{value} is in use; set {name}=<free port>")
            return 1

    supervisor = Supervisor(dict(os.environ))
    signal.signal(signal.SIGINT, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    svc: backing_servers.Services | None = None
    exit_code = 0
    embedded_before = {
        "pg": backing_servers.embedded_pg_pid() is not None,
        "redis": backing_servers.embedded_redis_pid() is not None,
    }
    try:
        svc = backing_servers.resolve("run")
        env = dict(os.environ)
        env.update(svc.env)
        env.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
        env["PYTHONUNBUFFERED"] = "1"
        local = env["DJANGO_SETTINGS_MODULE"].endswith(".local")
        if not env.get("FLOWER_BASIC_AUTH"):
            if not local:
                say("error: FLOWER_BASIC_AUTH must be set outside local development (user:pass)")
                return 1
            env["FLOWER_BASIC_AUTH"] = DEFAULT_FLOWER_AUTH
        supervisor.env = env
        (ROOT / "var").mkdir(exist_ok=True)

        say("migrating")
        manage(env, "migrate", "--noinput")
        superuser = ensure_dev_superuser(env)
        if superuser == "created":
            user, password = DEV_SUPERUSER
            say(f"created dev superuser {user} / {password} (local development only)")
        if manage_quiet(env, "help", "install_cleanup_schedule") == 0:
            # Create-if-missing: an operator's edit in the admin survives a restart.
            say("cleanup schedule: created as 4 shards every 10 s unless one exists (kept)")
            manage(env, "install_cleanup_schedule", "--shards", "4", "--every", "10")
        else:
            say("install_cleanup_schedule does not exist yet: no beat schedule installed")

        # Flower reads FLOWER_BASIC_AUTH from the environment (kept out of `ps`).
        supervisor.start("web", [PYTHON, "manage.py", "runserver", f"{HOST}:{port}"])
        supervisor.start(
            "worker",
            [CELERY, "-A", "config", "worker", "-c", "2",
             "-n", "worker1@%h", "--loglevel=INFO"],
        )  # fmt: skip
        supervisor.start("beat", [CELERY, "-A", "config", "beat"])
        supervisor.start("flower", flower_argv(flower_port))

        announced = False
        started_at = time.monotonic()
        while not supervisor.stopping:
            supervisor.reap()
            dead = supervisor.first_exited()
            if dead is not None:
                say(f"{dead.name} exited ({dead.process.returncode}): stopping everything")
                exit_code = 1
                break
            if not announced and (web_ready(port) or time.monotonic() - started_at > 30):
                announced = True
                with _print_lock:
                    print(
                        banner(port, flower_port, env["FLOWER_BASIC_AUTH"], superuser, svc),
                        flush=True,
                    )
            time.sleep(0.2)
    except Shutdown:
        exit_code = 130
    except subprocess.CalledProcessError as exc:
        say(f"error: {' '.join(map(str, exc.cmd[:4]))} ... exited {exc.returncode}")
        exit_code = 1
    except Exception as exc:  # noqa: BLE001
        say(f"error: {exc}")
        exit_code = 1
    finally:
        # From here on a signal must not interrupt the clean-up; a second one still forces.
        supervisor.stopping = True
        supervisor.stop_all()
        started = set(svc.started) if svc is not None else set()
        if svc is None:  # interrupted while finding services: stop what came up meanwhile
            now = {
                "pg": backing_servers.embedded_pg_pid() is not None,
                "redis": backing_servers.embedded_redis_pid() is not None,
            }
            started = {name for name, up in now.items() if up and not embedded_before[name]}
        if started:
            say(f"stopping embedded servers started by this run: {', '.join(sorted(started))}")
            backing_servers.stop_embedded(started)
        reap_orphans(None)
        say("stopped")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
