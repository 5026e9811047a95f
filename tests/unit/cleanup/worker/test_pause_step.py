"""The workers' side of "pause releases" (cleanup.worker.pause_step): the consumer bootstep driven
directly, reading the real switch in PostgreSQL, with a stand-in for Celery's worker consumer.

Celery's real consumer needs a broker connection to be built; the stand-in keeps only what the
bootstep touches, and does to the app's queue selection (Celery's own ``Queues``) what the real
``cancel_task_queue``/``add_task_queue`` do, so a reconnection rebuilds the task consumer from
the same selection a worker would. The timer runs its polls only when a test ticks it, so no
test waits for the poll interval.

Transactional database: the bootstep closes old connections on every poll, as a worker's main
process must, which would end a test's enclosing transaction.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.amqp import Queues
from django.db import connection
from kombu import Queue

from cleanup.conf import cleanup_settings
from cleanup.release import pause
from cleanup.worker.pause_step import POLL_INTERVAL_S, ReleasePause

pytestmark = [pytest.mark.django_db(transaction=True)]

CONF = cleanup_settings()
RELEASE = CONF.release_queue
SWEEP = CONF.sweep_queue
MAINTENANCE = CONF.maintenance_queue


@dataclass
class Repeated:
    """One ``call_repeatedly`` entry, as kombu's timer returns it: cancelling it ends the polls."""

    interval: float
    fun: Callable[..., Any]
    args: tuple[Any, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class StandInTimer:
    entries: list[Repeated] = field(default_factory=list)

    def call_repeatedly(
        self, secs: float, fun: Callable[..., Any], args: tuple[Any, ...] = (), **_: Any
    ) -> Repeated:
        entry = Repeated(secs, fun, args)
        self.entries.append(entry)
        return entry

    def active(self) -> list[Repeated]:
        return [e for e in self.entries if not e.cancelled]

    def tick(self) -> None:
        """The poll interval went by: every live repeated call runs once."""
        for entry in self.active():
            entry.fun(*entry.args)


class StandInConsumer:
    """What ``ReleasePause`` uses of Celery's worker consumer, started with ``-Q <queues>``."""

    def __init__(self, *queues: str) -> None:
        selection = Queues([Queue(name) for name in (SWEEP, RELEASE, MAINTENANCE)])
        selection.select(list(queues))
        self.app = SimpleNamespace(amqp=SimpleNamespace(queues=selection))
        self.timer = StandInTimer()
        self.calls: list[tuple[str, str]] = []
        self.consuming = set(selection.consume_from)

    def cancel_task_queue(self, queue: str) -> None:
        self.calls.append(("cancel", queue))
        self.app.amqp.queues.deselect(queue)
        self.consuming.discard(queue)

    def add_task_queue(self, queue: str) -> None:
        self.calls.append(("add", queue))
        selection = self.app.amqp.queues
        selection.select_add(selection[queue])
        self.consuming.add(queue)

    def rebuild_task_consumer(self) -> None:
        """After a broker reconnection Celery consumes the selected queues again."""
        self.consuming = set(self.app.amqp.queues.consume_from)


def started(*queues: str) -> tuple[StandInConsumer, ReleasePause]:
    c = StandInConsumer(*queues)
    step = ReleasePause(c)
    step.start(c)
    return c, step


@contextmanager
def database_unreachable() -> Iterator[None]:
    """The database stops answering: the open connection is dropped and every new one is
    refused (a port bound here, never listening). Put back as it was on leaving."""
    settings_before = dict(connection.settings_dict)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        connection.close()
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(closed.getsockname()[1]))
        try:
            yield
        finally:
            connection.close()
            connection.settings_dict.clear()
            connection.settings_dict.update(settings_before)


def test_a_release_worker_leaves_the_release_queue_while_paused_and_resumes_after() -> None:
    # given: a worker on every task queue, polling the switch
    c, _ = started(SWEEP, RELEASE, MAINTENANCE)
    assert c.calls == [] and c.consuming == {SWEEP, RELEASE, MAINTENANCE}
    assert [e.interval for e in c.timer.active()] == [POLL_INTERVAL_S]
    # when: an operator pauses releases
    pause.set_paused(True, "ops", "migration")
    c.timer.tick()
    # then: only the release queue is left; later polls change nothing
    assert c.consuming == {SWEEP, MAINTENANCE}
    c.timer.tick()
    assert c.calls == [("cancel", RELEASE)]
    # when: resumed
    pause.set_paused(False, "ops")
    c.timer.tick()
    c.timer.tick()
    # then: the release queue is consumed again, once
    assert c.consuming == {SWEEP, RELEASE, MAINTENANCE}
    assert c.calls == [("cancel", RELEASE), ("add", RELEASE)]


def test_a_worker_that_starts_while_paused_does_not_consume_the_release_queue() -> None:
    # given: releases already paused
    pause.set_paused(True, "ops", "incident")
    # when: a release worker starts
    c, _ = started(RELEASE)
    # then: it leaves the release queue before its first poll interval went by
    assert c.consuming == set() and c.calls == [("cancel", RELEASE)]


def test_a_failed_read_of_the_switch_keeps_a_paused_worker_paused_until_it_is_turned_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # given: a paused release worker
    pause.set_paused(True, "ops", "incident")
    c, _ = started(SWEEP, RELEASE)
    assert c.consuming == {SWEEP}
    # when: the database cannot be reached for a poll
    with caplog.at_level(logging.WARNING, logger="cleanup.pause"), database_unreachable():
        c.timer.tick()
    # then: the worker stays paused, and says why it could not read the switch
    assert c.consuming == {SWEEP} and c.calls == [("cancel", RELEASE)]
    assert "release pause: cannot read the switch" in caplog.messages
    # when: the database is back and the switch still on, nothing changes
    c.timer.tick()
    assert c.calls == [("cancel", RELEASE)]
    # when: the switch is turned off, the worker resumes
    pause.set_paused(False, "ops")
    c.timer.tick()
    assert c.consuming == {SWEEP, RELEASE}
    assert c.calls == [("cancel", RELEASE), ("add", RELEASE)]


def test_a_failed_read_of_the_switch_keeps_a_running_worker_running() -> None:
    # given: a release worker consuming
    c, _ = started(RELEASE)
    # when: the database cannot be reached for a poll, then is back with the switch off
    with database_unreachable():
        c.timer.tick()
    c.timer.tick()
    # then: it never stopped consuming
    assert c.consuming == {RELEASE} and c.calls == []


def test_a_worker_not_started_on_the_release_queue_never_consumes_it() -> None:
    # given: a sweep-only worker (-Q sweep), started while releases were paused
    pause.set_paused(True, "ops", "incident")
    c, step = started(SWEEP)
    c.timer.tick()
    # when: releases are resumed, and the worker reconnects to the broker
    pause.set_paused(False, "ops")
    c.timer.tick()
    step.stop(c)
    c.rebuild_task_consumer()
    step.start(c)
    c.timer.tick()
    # then: it never touched the release queue
    assert c.calls == []
    assert c.consuming == {SWEEP} and RELEASE not in c.app.amqp.queues.consume_from


def test_a_paused_worker_that_reconnects_stays_paused_and_resumes_when_turned_off() -> None:
    # given: a paused release worker
    pause.set_paused(True, "ops", "incident")
    c, step = started(SWEEP, RELEASE)
    # when: the broker connection is lost and the consumer restarted (Celery stops and starts
    # its steps, and rebuilds the task consumer from the selected queues)
    step.stop(c)
    c.rebuild_task_consumer()
    step.start(c)
    c.timer.tick()
    # then: still paused, with one poll going (the stopped one's timer was cancelled)
    assert c.consuming == {SWEEP} and len(c.timer.active()) == 1
    # when: resumed
    pause.set_paused(False, "ops")
    c.timer.tick()
    # then: the release queue is consumed again
    assert c.consuming == {SWEEP, RELEASE}
    assert c.calls == [("cancel", RELEASE), ("add", RELEASE)]
