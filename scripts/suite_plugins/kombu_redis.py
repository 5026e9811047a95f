"""kombu's own Redis transport tests (``t/unit/transport/test_redis.py`` of its sdist) with
``kombu.transport.redis.Channel`` and ``Transport`` replaced by ours
(``cleanup.worker.redis_transport``), so every test, and every test class the suite derives
from them (its ``Channel(redis.Channel)``), runs our overrides.

The replacement happens the moment ``kombu.transport.redis`` is first imported, which is when
the test module imports it: the module first swaps kombu's poller (``eventio.poll``) for a fake
one that kombu's Redis module binds at import, so importing kombu's module earlier (from here,
or from Django's set-up) would leave the real epoll in place and its fake sockets would fail
(``test_Redis::test_publish__consume``: "Bad file descriptor").

Django is not set up: the screening reads one setting through ``django.conf.settings`` (the
product's test settings, loaded lazily), and the only tests that would write a dead letter are
the ones listed in ``SCREENING_BYPASSED``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import pytest

from suite_plugins import report, select

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")

KOMBU_MODULE = "kombu.transport.redis"
SUITE = "t/unit/transport/test_redis.py"

# Tests that fail only because of the swap itself; everything else in the suite runs (kombu's
# Sentinel tests included: its SentinelChannel and SentinelTransport are swapped for ours too,
# and a sentinel:// URL selects ours through the scheme's alias).
DESELECT: dict[str, str] = {}

# Tests whose hand-written payloads are not kombu envelopes (an integer delivery tag, no
# delivery tag, a bare string as a broadcast), which our screening sets aside by design
# (docs/HARDENING.md). They run with the screening step replaced by kombu's bare decode, so
# they still check the rest of our overrides (restore_by_tag's transaction, _handle_message's
# call to kombu's, _receive_one's path) against kombu's behaviour.
SCREENING_BYPASSED = {
    f"{SUITE}::test_Channel::test_restore_by_tag_keeps_unacked_message_on_connection_error": (
        "its unacked entry has no delivery_tag"
    ),
    f"{SUITE}::test_Channel::test_restore_by_tag_requeues_when_lookup_succeeds": (
        "its unacked entry has no delivery_tag"
    ),
    f"{SUITE}::test_Channel::test_handle_pmessage_message": (
        "its broadcast payload is the string 'data'"
    ),
    f"{SUITE}::test_Channel::test_receive": "its broadcast's delivery_tag is the integer 1",
    **{
        f"{SUITE}::test_SentinelChannel_fanout_compat::{name}": (
            "its broadcasts are hand-written dicts without headers or content type"
        )
        for name in (
            "test_message_received_on_both_topics_is_delivered_once",
            "test_distinct_messages_are_all_delivered",
            "test_messages_without_delivery_tag_are_not_deduplicated",
            "test_deduplication_history_is_bounded",
            "test_disabled_does_not_deduplicate",
        )
    },
}


def _swap() -> None:
    from kombu.transport import redis

    from cleanup.worker import redis_transport

    redis.Channel = redis_transport.Channel  # type: ignore[misc]
    redis.Transport = redis_transport.Transport  # type: ignore[misc]
    redis.SentinelChannel = redis_transport.SentinelChannel  # type: ignore[misc]
    redis.SentinelTransport = redis_transport.SentinelTransport  # type: ignore[misc]


class _SwapAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _swap()


class _SwapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if name != KOMBU_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _SwapAfterExec(spec.loader)
        return spec


if KOMBU_MODULE in sys.modules:
    _swap()
else:
    sys.meta_path.insert(0, _SwapOnImport())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from kombu.transport import redis

    from cleanup.worker import redis_transport

    # Fail loudly rather than pass by testing kombu's own classes.
    if redis.Channel is not redis_transport.Channel or not any(
        isinstance(item, pytest.Function)
        and issubclass(item.module.Channel, redis_transport.Channel)  # type: ignore[attr-defined]
        for item in items
    ):
        raise pytest.UsageError("kombu's Redis suite is not running against our Channel")
    select(items, config, DESELECT, "kombu")
    missing = sorted(set(SCREENING_BYPASSED) - {item.nodeid for item in items})
    if missing:
        raise pytest.UsageError(f"kombu: screening-bypass tests not in this suite: {missing}")


@pytest.fixture(autouse=True)
def _kombu_decode_for_non_envelope_fixtures(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.nodeid in SCREENING_BYPASSED:
        from kombu.utils.encoding import bytes_to_str
        from kombu.utils.json import loads

        from cleanup.worker import redis_transport

        monkeypatch.setattr(
            redis_transport, "screen_entry", lambda item, queue: loads(bytes_to_str(item))
        )
        monkeypatch.setattr(redis_transport, "screen_broadcast", lambda data: None)
        monkeypatch.setattr(
            redis_transport, "parse_unacked", lambda raw: (loads(bytes_to_str(raw)), None)
        )
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    report(terminalreporter, "deselected: fail only because of the swap", DESELECT)
    report(
        terminalreporter,
        "run with kombu's bare decode instead of our screening",
        SCREENING_BYPASSED,
    )
