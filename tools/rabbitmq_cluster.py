"""Three RabbitMQ nodes of a caller's own, joined into one cluster: for the RabbitMQ cluster
drill (tests/integration/test_rabbitmq_cluster.py) and the publisher-confirms benchmark
(bench/publish_confirms.py).

Debian's ``rabbitmq-server`` scripts themselves (/usr/lib/rabbitmq/bin, not /usr/sbin's
wrappers, which run everything as the rabbitmq user with its cookie and the machine node's
environment file) run as the calling user, with the user's Erlang cookie. Each node has its own
name (``<prefix>N-<random>@localhost``), AMQP and distribution ports, and data, log and
configuration files under the given directory, no plugins; they are joined with ``rabbitmqctl
-n ... stop_app / join_cluster / start_app``. The machine's own RabbitMQ (on 5672) is never
touched.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import string
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path("/usr/lib/rabbitmq/bin")
# A node's pid as list_queues prints it: <node@host.1.2.3>
PID_NODE = re.compile(r"<(?P<node>[^<>]+@[^.<>]+)\.")


class MissingTool(RuntimeError):
    """Debian's rabbitmq-server is not installed here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise MissingTool("rabbitmq-server is missing: Debian's rabbitmq-server runs the nodes")
    return str(path)


def _erlang_cookie() -> None:
    """The nodes and rabbitmqctl authenticate with the user's cookie: made the way Erlang
    makes it when there is none yet, once, before three nodes start at the same time."""
    cookie = Path.home() / ".erlang.cookie"
    if not cookie.exists():
        cookie.write_text("".join(secrets.choice(string.ascii_uppercase) for _ in range(20)))
        cookie.chmod(0o400)


@dataclass
class Node:
    name: str
    root: Path
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def environment(self) -> dict[str, str]:
        files = {
            "RABBITMQ_CONFIG_FILE": self.root / "rabbitmq.conf",
            "RABBITMQ_ADVANCED_CONFIG_FILE": self.root / "advanced.config",
            "RABBITMQ_CONF_ENV_FILE": self.root / "rabbitmq-env.conf",
            "RABBITMQ_ENABLED_PLUGINS_FILE": self.root / "enabled_plugins",
            "RABBITMQ_MNESIA_BASE": self.root / "mnesia",
            "RABBITMQ_LOG_BASE": self.root / "log",
            "RABBITMQ_PID_FILE": self.root / "pid",
        }
        return {
            **os.environ,
            **{key: str(path) for key, path in files.items()},
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "rabbitmq.conf").write_text(
            "log.file.level = info\nlog.console = false\n"
            # a node that loses sight of the others' majority stops serving (no split brain)
            "cluster_partition_handling = pause_minority\n"
        )
        (self.root / "rabbitmq-env.conf").write_text("")
        (self.root / "enabled_plugins").write_text("[].\n")
        self.proc = subprocess.Popen(
            [_tool("rabbitmq-server")],
            env=self.environment(),
            cwd=self.root,
            stdout=(self.root / "server.out").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self) -> None:
        """SIGKILL the node's whole process group (the script, the Erlang VM, its helpers)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(15)

    def url(self, vhost: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}"


class Cluster:
    """Three RabbitMQ nodes of the caller's own, joined into one cluster; their files under
    ``root``, their names ``<prefix>N-<random>@localhost``."""

    def __init__(self, root: Path, prefix: str = "drill") -> None:
        tag = uuid.uuid4().hex[:6]
        self.nodes = [Node(f"{prefix}{i}-{tag}@localhost", root / f"node{i}") for i in (1, 2, 3)]

    def ctl(self, node: Node, *args: str, tool: str = "rabbitmqctl", timeout: float = 90) -> str:
        out = subprocess.run(
            [_tool(tool), "-q", "-n", node.name, *args],
            env=node.environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{tool} -n {node.name} {' '.join(args)}: {out.stderr[-600:]}")
        return out.stdout

    def await_startup(self, node: Node, timeout: float = 90) -> None:
        """Until the node has booted; ``await_startup`` itself gives up at once on a node that
        has not registered its name yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ctl(
                    node, "await_startup", "--timeout", str(int(timeout)), timeout=timeout + 30
                )
                return
            except RuntimeError:
                if time.monotonic() > deadline or node.proc is None or node.proc.poll() is not None:
                    raise
                time.sleep(0.5)

    def start(self) -> Cluster:
        _erlang_cookie()
        for node in self.nodes:  # booted side by side; joined one after the other
            node.start()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(self.await_startup, self.nodes))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
        running = self.ctl(first, "cluster_status", "--formatter", "json")
        assert all(node.name in running for node in self.nodes), running
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def add_vhost(self, vhost: str) -> None:
        node = self.alive()[0]
        self.ctl(node, "add_vhost", vhost)
        self.ctl(node, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def url(self, vhost: str, nodes: list[Node]) -> str:
        """kombu's failover form: every node, the first tried first."""
        return ";".join(n.url(vhost) for n in nodes)

    def queues(self, vhost: str) -> dict[str, dict[str, str]]:
        """Each queue of ``vhost`` as RabbitMQ lists it: type, the node that leads it (a classic
        queue's: where it lives), messages waiting and unacknowledged."""
        columns = [
            "name", "type", "leader", "pid", "messages_ready", "messages_unacknowledged",
            "consumers",
        ]  # fmt: skip
        out = self.ctl(self.alive()[0], "list_queues", "-p", vhost, *columns)
        found = {}
        for line in out.splitlines():
            values = line.split("\t")
            if len(values) == len(columns) and values[0] != "name":
                row = dict(zip(columns, values, strict=True))
                pid = PID_NODE.search(row["pid"])
                if not row["leader"] and pid:
                    row["leader"] = pid.group("node")
                found[row["name"]] = row
        return found

    def diagnosis(self, vhost: str) -> str:
        """What a stalled drain leaves to read: the vhost's consumers, channels, exchanges and
        bindings as a live node lists them (each listing's failure in its place)."""
        listings = {
            "consumers": ("list_consumers", "-p", vhost),
            "channels": (
                "list_channels", "name", "vhost", "consumer_count", "messages_unacknowledged",
                "prefetch_count", "confirm",
            ),
            "exchanges": ("list_exchanges", "-p", vhost, "name", "type", "durable", "auto_delete"),
            "bindings": ("list_bindings", "-p", vhost, "source_name", "destination_name",
                         "routing_key"),
        }  # fmt: skip
        parts = []
        for title, args in listings.items():
            try:
                parts.append(f"{title}:\n{self.ctl(self.alive()[0], *args, timeout=30)}")
            except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the failure
                parts.append(f"{title}: {exc!r}")
        return "\n".join(parts)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)
