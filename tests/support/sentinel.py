"""A Redis master and one sentinel of a test's own, on free ports (``sentinel://`` URLs), and
what the project names them."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.support.fleet import free_port
from tests.support.missing_tools import skip_for_missing

TRANSPORT = "cleanup.worker.redis_transport:SentinelTransport"  # the screened Sentinel transport
MASTER = "unit"  # the master's name the private sentinel monitors


class PrivateSentinel:
    """A redis-server and one sentinel watching it, on free ports in a directory of the test's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.master_port, self.sentinel_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel_port}/0"

    def start(self) -> PrivateSentinel:
        binary = shutil.which("redis-server")
        if binary is None:
            skip_for_missing("redis-server", "a private master and sentinel")
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master_port} 1\n"
        )
        for args in (
            ["--port", str(self.master_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.root)],
            [str(conf), "--sentinel"],
        ):  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    [binary, *args],
                    cwd=self.root,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                answer = redis.Redis(port=self.sentinel_port).execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER
                )
                if answer and redis.Redis(port=self.master_port).ping():
                    return self
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError("the private sentinel did not come up")

    def master(self) -> redis.Redis:
        return redis.Redis(port=self.master_port)

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
