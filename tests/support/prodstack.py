"""docker-compose.yml run as processes, without a container engine (the production-stack drill,
tests/integration/test_production_stack.py).

What comes from compose: ``docker-compose config`` (Debian's docker-compose) normalizes the file
with a ``.env`` beside it; every service's command, entrypoint, environment (env_file merged),
volumes, health check and ``depends_on`` conditions are taken from that output. Each service
runs in a network namespace of its own named after it (``<prefix>-<service>``), with a veth on
one bridge and a hosts file (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` puts in place of
/etc/hosts) that resolves every service name to its namespace's address, as compose's network
does. A small DNS responder on the bridge answers the same names for programs that ask DNS
directly (Prometheus's ``dns_sd_configs`` for ``worker``). Addresses are link-local
(169.254.N.0/24, the same kind the chaos drills use); nothing leaves the machine.

What stands in for each image (nothing is downloaded, no container runs):

- the app image (``build: .``): this checkout and its venv; the Dockerfile's WORKDIR (/app) is
  the checkout, its ENV lines are applied, its collectstatic step runs once into the drill's
  directory;
- ``postgres``: Debian's PostgreSQL server, initialized as the image's entrypoint does from
  POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB (password auth over TCP), socket in
  /var/run/postgresql inside its namespace;
- ``redis``: Debian's redis-server running compose's own command (the password from the env);
- ``prometheus`` / ``alertmanager``: Debian's ``prometheus`` and ``prometheus-alertmanager``
  running compose's entrypoint and command, with deploy/prometheus.yml, deploy/alerts.yml and
  deploy/alertmanager.yml bind-mounted unchanged;
- ``grafana`` is not packaged in Debian: not run (the drill runs each panel's query instead).

Every service gets a private /tmp (a tmpfs in its mount namespace, as a container has). A
volume is bind-mounted at its container path when that path's directory exists here
(/etc/prometheus); otherwise the container path is rewritten in the command to a directory of
the drill's own (named volumes, /app/var/flower, /prometheus, …).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import yaml

from tests.support import ROOT as ROOT

VENV_BIN = Path(sys.executable).parent
APP_WORKDIR = "/app"
PRIVATE_TMP = "mount -t tmpfs -o mode=1777 tmpfs /tmp"
# The image each service stands in for: its working directory and entrypoint (for `command`).
IMAGE_WORKDIR = {"redis": "/data", "prometheus": "/prometheus", "alertmanager": "/alertmanager"}
IMAGE_ENTRYPOINT = {"alertmanager": ["prometheus-alertmanager"]}
DEBIAN_PACKAGES = {
    "prometheus": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "redis-server": "redis-server",
    "docker-compose": "docker-compose",
}


def run(*cmd: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    return done


def postgres_bin() -> Path | None:
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: p.parts)
    return versions[-1].parent if versions else None


def missing_tools() -> list[str]:
    missing = [name for name in DEBIAN_PACKAGES if not shutil.which(name)]
    missing += [t for t in ("ip", "nsenter", "setpriv", "mount") if not shutil.which(t)]
    if postgres_bin() is None:
        missing.append("postgresql (server binaries)")
    return missing


# --- compose's normalized configuration ----------------------------------------------------


def normalized_compose(workdir: Path, dotenv: dict[str, str]) -> dict[str, Any]:
    """``docker-compose config`` of this checkout's docker-compose.yml with ``dotenv`` as its
    .env (a copy in ``workdir``: bind-mount sources then point into the checkout)."""
    workdir.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "docker-compose.yml").read_text()
    # Relative bind sources (./deploy/...) stay relative to the checkout, as in the original.
    text = text.replace("- ./", f"- {ROOT}/")
    (workdir / "docker-compose.yml").write_text(text)
    (workdir / ".env").write_text("".join(f"{k}={v}\n" for k, v in dotenv.items()))
    # Only the .env: compose prefers the calling shell's variables, and the test run has its own.
    clean = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    done = run("docker-compose", "config", cwd=workdir, env=clean)
    return yaml.safe_load(done.stdout)


def dockerfile_env() -> dict[str, str]:
    """The ENV lines of the Dockerfile (KEY=VALUE pairs, backslash continuations)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def start_order(services: dict[str, Any]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", {}) or {}:
            visit(dep)
        order.append(name)

    for name in sorted(services):
        visit(name)
    return order


# --- network -------------------------------------------------------------------------------


def _free_subnet() -> int:
    used = run("ip", "-4", "addr").stdout
    for third in range(230, 250):
        if f"169.254.{third}." not in used:
            return third
    raise RuntimeError("no free 169.254.N.0/24 for the drill's bridge")


class Network:
    """A bridge with the drill's address (.1) and one namespace per service (.10, .11, …)."""

    def __init__(self, services: list[str]) -> None:
        tag = f"{os.getpid() % 10000}"
        self.prefix = f"prodstack{tag}"
        self.bridge = f"ps{tag}br"
        self.third = _free_subnet()
        self.host_ip = f"169.254.{self.third}.1"
        self.names = {s: f"{self.prefix}-{s}" for s in services}
        self.ips = {s: f"169.254.{self.third}.{10 + i}" for i, s in enumerate(services)}
        self._links = {s: (f"ps{tag}h{i}", f"ps{tag}n{i}") for i, s in enumerate(services)}
        self.created: list[str] = []

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{ip} {name}" for name, ip in self.ips.items()]
        return "\n".join(lines) + "\n"

    def create(self) -> Network:
        run("ip", "link", "add", "name", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for service, ns in self.names.items():
            host_if, ns_if = self._links[service]
            run("ip", "netns", "add", ns)
            self.created.append(ns)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file())
            (etc / "resolv.conf").write_text(f"nameserver {self.host_ip}\n")
            run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            run("ip", "link", "set", host_if, "master", self.bridge)
            run("ip", "link", "set", host_if, "up")
            run("ip", "link", "set", ns_if, "netns", ns)
            for step in (
                ("ip", "addr", "add", f"{self.ips[service]}/24", "dev", ns_if),
                ("ip", "link", "set", ns_if, "up"),
                ("ip", "link", "set", "lo", "up"),
            ):
                run("ip", "netns", "exec", ns, *step)
        return self

    def delete(self) -> None:
        for ns in self.created:
            run("ip", "netns", "delete", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for host_if, _ in self._links.values():
            run("ip", "link", "delete", host_if, check=False)
        run("ip", "link", "delete", self.bridge, check=False)


class DnsResponder:
    """Answers A queries for the service names (compose's embedded DNS); anything else gets
    NXDOMAIN. One UDP socket on the bridge address, a thread of the drill."""

    def __init__(self, address: str, names: dict[str, str]) -> None:
        self.names = {n.lower(): ip for n, ip in names.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="prodstack-dns", daemon=True)
        self.thread.start()

    def answer(self, query: bytes) -> bytes:
        (qid, _flags, qdcount) = struct.unpack("!HHH", query[:6])
        pos, labels = 12, []
        while query[pos]:
            length = query[pos]
            labels.append(query[pos + 1 : pos + 1 + length].decode(errors="replace"))
            pos += 1 + length
        qtype, _qclass = struct.unpack("!HH", query[pos + 1 : pos + 5])
        question = query[12 : pos + 5]
        ip = self.names.get(".".join(labels).lower())
        if ip is None or qdcount != 1:
            return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
        if qtype != 1:  # a known name without that record type: no answer, no error
            return struct.pack("!HHHHHH", qid, 0x8180, 1, 0, 0, 0) + question
        record = struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
        return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + record

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except (TimeoutError, OSError):
                continue
            try:
                self.sock.sendto(self.answer(query), peer)
            except (IndexError, struct.error, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.sock.close()


# --- services ------------------------------------------------------------------------------


def _shell_free(value: str) -> str:
    return value.replace("$$", "$")  # compose's escape, kept by `config`


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    stack: Stack
    process: subprocess.Popen[bytes] | None = None
    mounts: list[tuple[str, str]] = field(default_factory=list)
    path_map: dict[str, str] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.stack.dir / "logs" / f"{self.name}.log"

    @property
    def is_app(self) -> bool:
        return "build" in self.spec

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {"PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        if self.is_app:
            env.update({k: self.map_path(v) for k, v in dockerfile_env().items()})
        for key, value in (self.spec.get("environment") or {}).items():
            env[key] = "" if value is None else str(value)
        return env

    def map_path(self, text: str) -> str:
        for container, here in sorted(self.path_map.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(
                rf"(?<![\w./-]){re.escape(container)}(?=$|[/\s\"':;,])",
                here.replace("\\", "/"),
                text,
            )
        return text

    def prepare_volumes(self) -> None:
        """Bind-mount where the container path's directory exists here; otherwise rewrite."""
        shadows: dict[str, Path] = {}
        for volume in self.spec.get("volumes") or []:
            if isinstance(volume, dict):
                source, target = str(volume["source"]), str(volume["target"])
            else:
                source, target = str(volume).split(":")[:2]
            if not source.startswith("/"):  # a named volume: a directory of the drill's
                named = self.stack.dir / "volumes" / source
                named.mkdir(parents=True, exist_ok=True)
                source = str(named)
            parent = os.path.dirname(target)
            if parent.count("/") >= 2 and os.path.isdir(parent):
                shadow = shadows.setdefault(
                    parent, self.stack.dir / "mounts" / self.name / parent[1:]
                )
                shadow.mkdir(parents=True, exist_ok=True)
                placeholder = shadow / os.path.basename(target)
                if os.path.isdir(source):
                    placeholder.mkdir(exist_ok=True)
                else:
                    placeholder.touch()
                self.mounts.append((source, str(placeholder)))
            else:
                self.path_map[target] = source
        for parent, shadow in shadows.items():
            self.mounts.append((str(shadow), parent))
        if self.is_app:
            self.path_map.setdefault(APP_WORKDIR, str(ROOT))
            self.path_map.setdefault(f"{APP_WORKDIR}/var/static", str(self.stack.dir / "static"))
        elif self.name in IMAGE_WORKDIR:
            workdir = IMAGE_WORKDIR[self.name]
            if workdir not in self.path_map:
                own = self.stack.dir / "volumes" / f"{self.name}-workdir"
                own.mkdir(parents=True, exist_ok=True)
                self.path_map[workdir] = str(own)

    def workdir(self) -> str:
        if self.is_app:
            return str(ROOT)
        if self.name in IMAGE_WORKDIR:
            return self.map_path(IMAGE_WORKDIR[self.name])
        return str(self.stack.dir)

    def argv(self) -> list[str]:
        def listed(value: Any) -> list[str]:
            if value is None:
                return []
            return list(value) if isinstance(value, list) else shlex.split(str(value))

        entrypoint = listed(self.spec.get("entrypoint")) or IMAGE_ENTRYPOINT.get(self.name, [])
        command = listed(self.spec.get("command"))
        return [self.map_path(_shell_free(a)) for a in [*entrypoint, *command]]

    def wrapper(self, argv: list[str], extra: str = "") -> list[str]:
        """`ip netns exec` (network namespace, hosts file, a mount namespace), then a private
        /tmp and the bind mounts, then the command."""
        steps = self.stack.private_tmp()
        steps += [f"mount --rbind {shlex.quote(s)} {shlex.quote(t)}" for s, t in self.mounts]
        if extra:
            steps.append(extra)
        script = " && ".join(steps) + ' && exec "$@"'
        ns = self.stack.network.names[self.name]
        return ["ip", "netns", "exec", ns, "/bin/sh", "-c", script, "sh", *argv]

    def start(self, argv: list[str] | None = None, extra: str = "") -> Service:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.wrapper(argv or self.argv(), extra),
                cwd=self.workdir(),
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exec(
        self, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`docker compose exec <service> …`: the service's namespaces, environment, workdir."""
        assert self.process is not None and self.alive(), f"{self.name} is not running"
        # Until `ip netns exec` and the wrapper have exec'd the service, its pid is still in the
        # machine's mount namespace (the shared servers' sockets): never enter it then.
        cmdline = Path(f"/proc/{self.process.pid}/cmdline")

        def setting_up() -> bool:
            args = cmdline.read_bytes()
            return args.startswith(b"ip\0netns") or PRIVATE_TMP.encode() in args

        deadline = time.monotonic() + 15
        while setting_up() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not setting_up(), f"{self.name} did not start"
        return subprocess.run(
            ["nsenter", "-t", str(self.process.pid), "-m", "-n", "--wd=" + self.workdir(), *argv],
            env={**self.environment(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def oneoff(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`docker compose run --rm <service> …`: a new process in the service's network
        namespace, with its environment, volumes and a private /tmp."""
        return subprocess.run(
            self.wrapper(argv),
            cwd=self.workdir(),
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def healthcheck(self) -> bool:
        test = (self.spec.get("healthcheck") or {}).get("test")
        if not test:
            return self.alive()
        if isinstance(test, str):
            argv = ["/bin/sh", "-c", test]
        elif test[0] == "CMD-SHELL":
            argv = ["/bin/sh", "-c", _shell_free(" ".join(test[1:]))]
        else:
            argv = [_shell_free(a) for a in test[1:]]
        try:
            return self.exec(argv, timeout=30).returncode == 0
        except (subprocess.TimeoutExpired, AssertionError):
            return False

    def stop(self, timeout: float = 45) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (compose's stop_grace_period)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        # children a killed group leader left (gunicorn workers, pool processes)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class Stack:
    """The whole compose file as processes. ``up()`` starts the services in dependency order,
    honouring ``service_healthy`` / ``service_completed_successfully``; ``down()`` stops them
    all and removes the namespaces, the bridge and the drill's directory."""

    SKIPPED = {"grafana": "not packaged in Debian: the dashboard's queries are run instead"}

    def __init__(self, dotenv: dict[str, str]) -> None:
        # Outside /tmp: every service has a private /tmp, and PostgreSQL runs as `postgres`.
        self.dir = Path(tempfile.mkdtemp(prefix="prodstack-", dir="/var/tmp"))
        os.chmod(self.dir, 0o755)
        self.config = normalized_compose(self.dir / "compose", dotenv)
        self.services_spec: dict[str, Any] = self.config["services"]
        self.network = Network(sorted(self.services_spec))
        self.services: dict[str, Service] = {}
        self.dns: DnsResponder | None = None
        self.timeline: list[tuple[float, str]] = []
        self.t0 = time.monotonic()

    def private_tmp(self) -> list[str]:
        """Mount a private /tmp in a service's mount namespace, keeping the checkout and the
        virtualenv where they are when they live under /tmp (a clean clone in a `mktemp -d`
        directory, as CI may make): each is bind-mounted aside (under the stack's directory,
        outside /tmp) before the tmpfs hides it, and back at its own path after."""
        kept = [p for p in (ROOT, VENV_BIN.parent) if p.is_relative_to("/tmp")]
        kept = [p for p in kept if not any(p != q and p.is_relative_to(q) for q in kept)]
        aside = [self.dir / "kept" / str(i) for i in range(len(kept))]
        for directory in aside:
            directory.mkdir(parents=True, exist_ok=True)
        q = shlex.quote
        return [
            *(f"mount --rbind {q(str(p))} {q(str(a))}" for p, a in zip(kept, aside, strict=True)),
            PRIVATE_TMP,
            *(
                f"mkdir -p {q(str(p))} && mount --rbind {q(str(a))} {q(str(p))}"
                for p, a in zip(kept, aside, strict=True)
            ),
        ]

    def note(self, what: str) -> None:
        elapsed = time.monotonic() - self.t0
        self.timeline.append((elapsed, what))
        print(f"[prodstack {elapsed:6.1f}s] {what}", flush=True)

    def ip(self, service: str) -> str:
        return self.network.ips[service]

    # -- images -------------------------------------------------------------------------

    def build_app_image(self) -> None:
        """The Dockerfile's build step: collectstatic with the local settings module."""
        env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")},
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DEBUG": "false",
            "STATIC_ROOT": str(self.dir / "static"),
        }
        run(sys.executable, "manage.py", "collectstatic", "--noinput", cwd=ROOT, env=env)

    def start_postgres(self, service: Service) -> None:
        """postgres:16's entrypoint on Debian's server: initdb as POSTGRES_USER with
        POSTGRES_PASSWORD (scram over TCP), then POSTGRES_DB."""
        env = service.environment()
        bindir = postgres_bin()
        assert bindir is not None
        data = self.dir / "volumes" / "pgdata-cluster"
        data.mkdir(parents=True, exist_ok=True)
        pwfile = self.dir / "pgpass"
        pwfile.write_text(env["POSTGRES_PASSWORD"] + "\n")
        shutil.chown(data, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
        as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        run(
            *as_postgres, str(bindir / "initdb"), "-D", str(data), "-U", env["POSTGRES_USER"],
            f"--pwfile={pwfile}", "--auth-local=trust", "--auth-host=scram-sha-256",
            "--encoding=UTF8", "--no-sync",
        )  # fmt: skip
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write("host all all 0.0.0.0/0 scram-sha-256\n")
        socket_dir = "/var/run/postgresql"
        service.start(
            [*as_postgres, str(bindir / "postgres"), "-D", str(data), "-c", "listen_addresses=*",
             "-c", f"unix_socket_directories={socket_dir}", "-c", "fsync=off"],
            extra=f"mount -t tmpfs -o mode=2777 tmpfs {socket_dir}",
        )  # fmt: skip
        self.wait(lambda: service.exec(["pg_isready", "-q"]).returncode == 0, 60, "postgres up")
        created = service.exec(
            ["psql", "-U", env["POSTGRES_USER"], "-d", "postgres", "-c",
             f'CREATE DATABASE "{env["POSTGRES_DB"]}"'],
        )  # fmt: skip
        assert created.returncode == 0, created.stderr

    # -- lifecycle ------------------------------------------------------------------------

    def wait(self, ok: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = ok()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for: {what}")
            time.sleep(0.5)

    def up(self, seed: Callable[[Stack], None] | None = None) -> None:
        self.network.create()
        self.dns = DnsResponder(self.network.host_ip, self.network.ips)
        self.build_app_image()
        self.note("network, DNS and the app image's static files ready")
        for name in start_order(self.services_spec):
            spec = self.services_spec[name]
            if name in self.SKIPPED:
                self.note(f"{name}: skipped ({self.SKIPPED[name]})")
                continue
            for dep, cond in (spec.get("depends_on") or {}).items():
                condition = cond.get("condition") if isinstance(cond, dict) else None
                self.wait_condition(dep, str(condition or "service_started"))
            service = Service(name, spec, self)
            service.prepare_volumes()
            self.services[name] = service
            if name == "postgres":
                self.start_postgres(service)
            else:
                service.start()
            self.note(f"{name}: started ({shlex.join(service.argv())[:160]})")
            if name == "migrate" and seed is not None:
                self.wait_condition("migrate", "service_completed_successfully")
                seed(self)

    def wait_condition(self, name: str, condition: str) -> None:
        service = self.services[name]
        if condition == "service_completed_successfully":
            assert service.process is not None
            code = service.process.wait(timeout=180)
            assert code == 0, f"{name} exited {code}:\n{service.log_tail()}"
        elif condition == "service_healthy":
            self.wait_healthy(name)

    def wait_healthy(self, name: str, timeout: float = 120) -> None:
        service = self.services[name]

        def healthy() -> bool:
            if not service.alive():
                raise AssertionError(f"{name} exited:\n{service.log_tail()}")
            return service.healthcheck()

        self.wait(healthy, timeout, f"{name} healthy ({service.spec.get('healthcheck')})")

    def down(self) -> None:
        for name in reversed(list(self.services)):
            try:
                self.services[name].stop(timeout=20)
            except Exception as exc:  # noqa: BLE001 - stop the rest whatever happens
                print(f"[prodstack] stopping {name}: {exc!r}")
        if self.dns is not None:
            self.dns.close()
        self.network.delete()
        if not os.environ.get("PRODSTACK_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- clients --------------------------------------------------------------------------

    def http(
        self, service: str, port: int, path: str, *, host: str | None = None, **kw: Any
    ) -> tuple[int, bytes, dict[str, str]]:
        url = f"http://{self.ip(service)}:{port}{path}"
        request = urllib.request.Request(url, headers={"Host": host or f"{service}:{port}"}, **kw)
        try:
            with urllib.request.urlopen(request, timeout=20) as response:
                return response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as err:
            return err.code, err.read(), dict(err.headers)

    def prometheus(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        status, body, _ = self.http("prometheus", 9090, f"{path}?{query}")
        assert status == 200, body[:500]
        return json.loads(body)["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return list(self.prometheus("/api/v1/query", **params)["result"])

    def alerts(self) -> dict[str, str]:
        """Prometheus's alerts by name: pending or firing (the worst state of its series)."""
        states: dict[str, str] = {}
        for alert in self.prometheus("/api/v1/alerts")["alerts"]:
            name, state = alert["labels"]["alertname"], alert["state"]
            if states.get(name) != "firing":
                states[name] = state
        return states

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        status, body, _ = self.http("alertmanager", 9093, "/api/v2/alerts?active=true")
        assert status == 200, body[:500]
        return list(json.loads(body))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.prometheus("/api/v1/targets")["activeTargets"])


class Browser:
    """A cookie-keeping HTTP client for the web (the published port's Host)."""

    def __init__(self, stack: Stack, host: str = "localhost:8000") -> None:
        self.base = f"http://{stack.ip('web')}:8000"
        self.host = host
        self.jar = CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def request(self, path: str, data: dict[str, str] | None = None) -> tuple[int, str, str]:
        body = urllib.parse.urlencode(data).encode() if data is not None else None
        headers = {"Host": self.host}
        if data is not None:
            headers["Referer"] = f"http://{self.host}{path}"
        request = urllib.request.Request(self.base + path, data=body, headers=headers)
        try:
            with self.opener.open(request, timeout=20) as response:
                final = urllib.parse.urlsplit(response.geturl()).path
                return response.status, response.read().decode(errors="replace"), final
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace"), path

    def login(self, username: str, password: str) -> tuple[int, str, str]:
        _, page, _ = self.request("/admin/login/?next=/admin/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, page[:500]
        return self.request(
            "/admin/login/?next=/admin/",
            {
                "csrfmiddlewaretoken": token.group(1),
                "username": username,
                "password": password,
                "next": "/admin/",
            },
        )


# --- what the alerts, dashboards and manifests query --------------------------------------

_PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip


def selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression (metric name with its label matchers)."""
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    found: list[str] = []
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", text):
        name, labels = match.group(1), match.group(2) or ""
        rest = text[match.end() :].lstrip()
        if name.lower() in _PROMQL_WORDS or rest.startswith("("):
            continue
        if match.start() > 0 and text[match.start() - 1] in "\"'":
            continue
        found.append(name + labels)
    return sorted(set(found))


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


# What Grafana puts in place of the dashboard's variables, with every shard and queue selected
# ("All" is ".*") and this Prometheus's 15 s scrape interval ($__rate_interval is the larger of
# four scrape intervals and the step plus one scrape interval).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$shard": ".*", "$queue": ".*"}


def grafana_interpolate(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression as Grafana sends it) of every panel target of every provisioned
    dashboard."""
    out: list[tuple[str, str]] = []
    for path in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = grafana_interpolate(target["expr"])
                out.append((f"{path.stem}: {panel['title']}", expr))
    return out


def k8s_queries() -> list[tuple[str, str]]:
    """KEDA triggers' queries and the HPA's external metric names (as selectors)."""
    out: list[tuple[str, str]] = []
    for path in sorted((ROOT / "deploy" / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc.get("kind") == "ScaledObject":
                for trigger in doc["spec"]["triggers"]:
                    out.append((f"{path.name}: {trigger['name']}", trigger["metadata"]["query"]))
            if doc.get("kind") == "HorizontalPodAutoscaler":
                for metric in doc["spec"].get("metrics", []):
                    if metric.get("type") == "External":
                        name = metric["external"]["metric"]["name"]
                        out.append((f"{path.name}: {name}", name))
    return out
