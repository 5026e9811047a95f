"""The workers' remote-control channel, screened (cleanup.worker.remote_control): commands
outside the allowed ones are dropped, the ones the tools send pass, and a green pool's control
consumer is screened too."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from cleanup.worker import remote_control
from config.celery_app import app

REPLY = "reply.celery.pidbox"

ALLOWED = frozenset({"ping", "stats"})


@pytest.mark.parametrize(
    ("body", "headers", "reason", "words"),
    [
        ([], {}, "malformed", "body is a list"),
        ({"method": "shutdown"}, {}, "not_allowed", "'shutdown' is not in"),
        ({"method": "pool_shrink", "arguments": {"n": 1}}, {}, "not_allowed", "pool_shrink"),
        ({"method": 1}, {}, "malformed", "'method'"),
        ({"method": "ping", "arguments": [1]}, {}, "malformed", "'arguments'"),
        ({"method": "ping", "destination": "w1"}, {}, "malformed", "'destination'"),
        ({"method": "ping", "pattern": "(a+)+$", "matcher": "pcre"}, {}, "malformed", "glob"),
        (
            {"method": "ping", "reply_to": {"exchange": "", "routing_key": "cleanup"}},
            {},
            "malformed",
            "'reply_to'",
        ),
        ({"method": "ping", "extra": 1}, {}, "malformed", "'extra'"),
        ({"method": "ping"}, {"clock": "x"}, "malformed", "'clock'"),
        # a clock every reply would then carry: thousands of digits broke their encoding
        ({"method": "ping"}, {"clock": 10**1000}, "malformed", "'clock' is out of range"),
        ({"method": "ping"}, {"clock": 2**63}, "malformed", "'clock' is out of range"),
        # the clock's next step would not fit a reply's 64-bit AMQP header: ping went silent
        ({"method": "ping"}, {"clock": 2**63 - 1}, "malformed", "'clock' is out of range"),
        ({"method": "ping"}, {"clock": 2**53}, "malformed", "'clock' is out of range"),
        ({"method": "ping"}, {"expires": "soon"}, "malformed", "'expires'"),
        ({"method": "ping"}, {"expires": float("inf")}, "malformed", "'expires'"),
        ({"method": "ping"}, {"x-custom": "1"}, "malformed", "'x-custom' is not one"),
        ({"method": "ping"}, [("clock", 1)], "malformed", "headers are not a table"),
        # an AMQP routing key holds 255 bytes; the ticket is echoed in the reply's header
        (
            {"method": "ping", "reply_to": {"exchange": REPLY, "routing_key": "r" * 256}},
            {},
            "malformed",
            "routing key is longer than 255 bytes",
        ),
        ({"method": "ping", "ticket": "t" * 256}, {}, "malformed", "'ticket'"),
        ({"method": "ping", "ticket": "é" * 128}, {}, "malformed", "'ticket'"),  # 256 bytes
        ({"method": "ping", "destination": ["w" * 256]}, {}, "malformed", "'destination'"),
        ({"method": "ping", "destination": ["w"] * 1001}, {}, "malformed", "'destination'"),
        ({"method": "ping", "pattern": "*" * 256, "matcher": "glob"}, {}, "malformed", "glob"),
        ({"method": "ping", "arguments": {"a": "x" * 70_000}}, {}, "malformed", "'arguments'"),
    ],
)
def test_a_control_message_outside_the_allowed_commands_is_dropped(
    body: Any, headers: dict[str, Any], reason: str, words: str
) -> None:
    problem = remote_control.check_command(body, headers, ALLOWED, REPLY)
    assert problem is not None and problem[0] == reason and words in problem[1]


def test_the_commands_the_tools_send_pass() -> None:
    # what `celery inspect ping -d w1@host` and Flower's stats page send
    for body in (
        {
            "method": "ping",
            "arguments": {},
            "destination": ["w1@host"],
            "pattern": None,
            "matcher": None,
            "reply_to": {"exchange": REPLY, "routing_key": "5609b3fb"},
            "ticket": "a1",
        },
        {"method": "stats", "arguments": None, "destination": None},
    ):
        assert remote_control.check_command(body, {"clock": 7}, ALLOWED, REPLY) is None
        headers = {"clock": 2**53 - 1, "expires": 1.8e9}  # the bounds themselves pass
        assert remote_control.check_command(body, headers, ALLOWED, REPLY) is None


def test_a_command_celery_does_not_have_fails_the_worker_start(settings: Any) -> None:
    settings.CLEANUP_REMOTE_CONTROL_COMMANDS = ["ping", "shutdwon"]
    with pytest.raises(ImproperlyConfigured, match="CLEANUP_REMOTE_CONTROL_COMMANDS.*shutdwon"):
        remote_control.allowed_commands()


def test_the_green_pools_control_consumer_is_screened_too() -> None:
    """A green pool (gevent, eventlet) starts its control consumer in a greenlet of its own, after
    the bootstep's start: the screening must neither expect it at start (the worker crashed at
    start-up with AttributeError, seen with ``--pool gevent``) nor miss it when it is made."""
    from types import SimpleNamespace

    from kombu import Connection

    spawned: list[Any] = []
    c = SimpleNamespace(
        app=app,
        hostname="w1@host",
        controller=SimpleNamespace(use_eventloop=False),
        pool=SimpleNamespace(spawn_n=lambda fn, *args: spawned.append(fn)),
    )
    box = remote_control.ScreenedGreenPidbox(c)
    box.start(c)  # hands its loop to the pool; no consumer yet
    assert spawned == [box.loop]
    with Connection("memory://") as connection:
        box._do_reset(c, connection)  # what the loop does first, in its greenlet
        assert box.consumer.on_decode_error == box.on_decode_error
