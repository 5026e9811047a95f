"""Redis Sentinel (``sentinel://``): the screened Sentinel transport is the screened channel with
kombu's Sentinel connection logic, a failover switch keeps it, the direct Redis clients ask the
sentinels for the master, and a Sentinel setting the project cannot support is refused at
start-up naming the variable. Real servers: a redis-server and one sentinel of the test's own on
free ports (the failover itself is tests/integration/test_sentinel_failover.py)."""

from __future__ import annotations

import inspect
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.transport import redis as kombu_redis

from cleanup import redis_clients
from cleanup.models import DeadLetter
from cleanup.worker import redis_transport
from tests.support.child_python import run_with
from tests.support.fleet import free_port
from tests.support.missing_tools import skip_for_missing
from tests.unit.config.settings.test_production import load_production, refusal

TRANSPORT = "cleanup.worker.redis_transport:SentinelTransport"
MASTER = "unit"


def _own_names(cls: type) -> set[str]:
    return {name for name in vars(cls) if not (name.startswith("__") and name != "__init__")}


def test_every_screened_method_is_the_one_a_sentinel_channel_runs() -> None:
    # given: what the screened channel overrides, and what kombu's Sentinel channel adds
    screened = _own_names(redis_transport.Channel)
    sentinel = _own_names(kombu_redis.SentinelChannel)
    # then: neither overrides the other (kombu overriding a screened method would need review)
    assert screened & sentinel == set()
    # and: the screened methods and QoS win, kombu's Sentinel pool and fan-out logic is kept
    for name in screened:
        assert (
            inspect.getattr_static(redis_transport.SentinelChannel, name)
            is vars(redis_transport.Channel)[name]
        ), name
    # (what the project's Sentinel channel defines itself is checked by its own tests below)
    for name in sentinel - {"__init__", "QoS"} - set(vars(redis_transport.SentinelChannel)):
        assert (
            inspect.getattr_static(redis_transport.SentinelChannel, name)
            is vars(kombu_redis.SentinelChannel)[name]
        ), name
    assert redis_transport.SentinelChannel.QoS is redis_transport.ScreenedQoS
    assert redis_transport.SentinelTransport.Channel is redis_transport.SentinelChannel
    assert redis_transport.SentinelTransport.default_port == 26379


def test_a_failed_connection_switching_to_the_next_sentinel_keeps_the_screened_transport() -> None:
    # given: a broker connection over two sentinels, as Celery makes it from the settings
    conn = Connection("sentinel://127.0.0.1:1;sentinel://127.0.0.1:2", transport=TRANSPORT)
    assert conn.transport_cls == TRANSPORT
    # when: kombu switches to the next URL, as it does after a failed connection attempt
    conn.maybe_switch_next()
    # then: the URL's scheme selects the project's transport, not kombu's unscreened one
    assert conn.port == 2
    assert type(conn.transport) is redis_transport.SentinelTransport


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


@pytest.fixture
def private_sentinel(tmp_path: Path) -> Iterator[PrivateSentinel]:
    server = PrivateSentinel(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def _sentinel_connection(sentinel: PrivateSentinel) -> Connection:
    """A kombu connection of the screened Sentinel transport, told only the sentinel's URL and
    the master's name (as a worker is)."""
    conn = Connection(sentinel.url, transport=TRANSPORT)
    conn.transport_options = {"master_name": MASTER}
    return conn


@pytest.mark.django_db
def test_an_entry_that_is_not_json_is_dead_lettered_by_a_channel_made_through_a_sentinel(
    private_sentinel: PrivateSentinel,
) -> None:
    # given: a channel of the screened Sentinel transport, told only the sentinel and the name
    conn = _sentinel_connection(private_sentinel)
    try:
        channel: Any = conn.default_channel
        assert type(channel) is redis_transport.SentinelChannel
        # when: the master's queue holds an entry that stops kombu's own channel
        private_sentinel.master().lpush("sentinel-unit", b"not json at all")
        # then: the screened read sets it aside as a dead letter, and the channel reads on
        with pytest.raises(Empty):
            channel._get("sentinel-unit")
    finally:
        conn.release()
    letter = DeadLetter.objects.get()
    assert letter.error.startswith("not a broker envelope: not JSON")
    assert private_sentinel.master().llen("sentinel-unit") == 0


@pytest.mark.django_db
def test_closing_a_channel_whose_connection_is_gone_keeps_its_unacked_message_and_the_worker(
    private_sentinel: PrivateSentinel,
) -> None:
    # given: a message delivered and not acknowledged on a channel of the Sentinel transport
    conn = _sentinel_connection(private_sentinel)
    channel: Any = conn.channel()
    with conn.Producer(channel) as producer:
        producer.publish({"x": 1}, routing_key="sentinel-unit", serializer="json")
    assert channel.basic_get("sentinel-unit", no_ack=False) is not None
    # when: the channel is closed after its broker connection was dropped, as Celery does when
    # the master dies (kombu's close needs a new pool to restore the message, and the client
    # it builds that pool from is gone)
    channel._disconnect_pools()
    channel.connection.client = None
    with pytest.raises(conn.connection_errors):
        channel.close()
    # then: a connection error, which Celery's release ignores (an AttributeError stopped the
    # worker), and the message is still in the ack bookkeeping for the visibility timeout
    assert private_sentinel.master().hlen("unacked") == 1


def test_a_direct_client_of_a_sentinel_url_reaches_the_master_the_sentinels_name(
    private_sentinel: PrivateSentinel, settings: Any
) -> None:
    settings.CELERY_BROKER_SENTINEL_MASTER = MASTER
    client = redis_clients.client(private_sentinel.url)
    client.set("sentinel-unit:probe", b"1")
    assert private_sentinel.master().get("sentinel-unit:probe") == b"1"
    assert client.connection_pool.get_master_address()[1] == private_sentinel.master_port  # type: ignore[attr-defined]
    # one client per URL per process, and none inherited across a fork (as for redis://)
    assert redis_clients.client(private_sentinel.url) is client
    redis_clients._forget_inherited_clients()
    assert redis_clients.client(private_sentinel.url) is not client


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"CELERY_BROKER_URL": "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"},
            "CELERY_BROKER_URL is a sentinel:// URL but CELERY_BROKER_SENTINEL_MASTER is not set",
        ),
        (
            {"CELERY_BROKER_SENTINEL_MASTER": MASTER},
            "CELERY_BROKER_SENTINEL_MASTER is set but neither CELERY_BROKER_URL nor "
            "CLEANUP_COUNTER_REDIS_URL is a sentinel:// URL",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379;redis://127.0.0.1:6379/0",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CELERY_BROKER_URL (entry 2): every entry of a Sentinel URL must be sentinel://",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379/0?ssl_cert_reqs=required",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CELERY_BROKER_URL (entry 1): options in a sentinel:// URL are not supported",
        ),
        (
            {
                "CELERY_BROKER_URL": "sentinel://127.0.0.1:26379/0",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
                "REDIS_TLS_VERIFY": "required",
            },
            "REDIS_TLS_VERIFY is set but CELERY_BROKER_URL is a sentinel:// URL: TLS to Sentinel "
            "is not supported",
        ),
        (
            {
                "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
                "CLEANUP_COUNTER_REDIS_URL": "sentinel://127.0.0.1:26379/x",
                "CELERY_BROKER_SENTINEL_MASTER": MASTER,
            },
            "CLEANUP_COUNTER_REDIS_URL (entry 1): the database 'x' is not a number",
        ),
        (
            {"CELERY_BROKER_URL": "redis+socket:///tmp/redis.sock"},
            "CELERY_BROKER_URL: expected a redis://, rediss://, sentinel:// or amqp:// URL",
        ),
    ],
)
def test_a_sentinel_setting_the_project_cannot_support_is_refused_naming_the_variable(
    env: dict[str, str], words: str
) -> None:
    out = run_with("import django; django.setup()", **env)
    assert out.returncode != 0
    assert f"ImproperlyConfigured: {words}" in out.stderr, out.stderr[-800:]


def test_a_sentinel_broker_selects_the_screened_sentinel_transport_with_the_master_name() -> None:
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.CELERY_BROKER_TRANSPORT, s.CELERY_BROKER_TRANSPORT_OPTIONS, "
        "s.BROKER_IS_REDIS, s.CLEANUP_COUNTER_REDIS_URL]))"
    )
    url = "sentinel://:pw@127.0.0.1:26379/2;sentinel://localhost:26380/2"
    out = run_with(code, CELERY_BROKER_URL=url, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert out.returncode == 0, out.stderr[-800:]
    transport, options, is_redis, counters = json.loads(out.stdout)
    assert transport == TRANSPORT
    assert options["master_name"] == MASTER
    assert is_redis is True
    assert counters == url  # the delivery counters follow the master through the sentinels too


def test_production_refuses_a_remote_sentinel_without_a_password_and_example_passwords() -> None:
    remote = "sentinel://s1.internal:26379/0;sentinel://s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=remote, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert "CELERY_BROKER_URL has no password and its host (s1.internal) is not local" in refusal(
        out
    )
    example = "sentinel://:pw@s1.internal:26379/0;sentinel://:change-me-redis@s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=example, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert "CELERY_BROKER_URL carries a development or example password" in refusal(out)
    strong = "sentinel://:Zq2Lm5Xv9Rb3@s1.internal:26379/0;sentinel://s2.internal:26379/0"
    out = load_production(CELERY_BROKER_URL=strong, CELERY_BROKER_SENTINEL_MASTER=MASTER)
    assert out.returncode == 0, out.stderr[-800:]
