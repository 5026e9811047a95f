"""Hostile and corrupt input against a real worker on the real broker.

Each case is published the way an attacker with write access to the broker (or a Flower login)
could, one at a time, and each must end as one dead letter with a reason while the worker's main
process stays up and keeps releasing valid holds. Runs on Redis and, with ``CELERY_BROKER_URL``
set to an ``amqp://`` URL, on RabbitMQ (the Redis-only cases skip there: RabbitMQ has no
envelope to corrupt; the RabbitMQ-only ones, AMQP header tables, skip on Redis).
"""

from __future__ import annotations

import bz2
import json
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release.messages import ReleaseMessage
from cleanup.release.publish import publish_release_messages
from tests.support.fleet import (
    Worker,
    create_eligible_holds,
    free_port,
    invariant_violations,
    log_lines,
    outcome_counts,
    purge_broker,
    queue_settled,
    scalar,
    scrape_worker,
    total,
    wait_until,
)
from tests.support.wire import RELEASE_TASK, publish_raw, signature_for
from tests.support.wire import release_message as _good
from tests.support.wire import task_body as _body

pytestmark = [pytest.mark.workers]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def push_redis_entry(entry: bytes | str) -> str:
    """LPUSH a raw entry onto the release queue's Redis list, as anything that can write to
    Redis could: no kombu envelope at all, or a broken one."""
    from cleanup.broker.readers import redis_client

    redis_client().lpush(cleanup_settings().release_queue, entry)
    return ""


def publish_deep_headers(depth: int) -> str:
    """A valid release body whose AMQP header table nests ``depth`` tables deep. py-amqp's
    encoder recurses once per level too, so the recursion limit is raised while publishing."""
    deep: dict[str, Any] = {}
    for _ in range(depth):
        deep = {"d": deep}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * depth + 1000))
    try:
        publish_raw(_body(_good()), headers={"deep": deep})
    finally:
        sys.setrecursionlimit(limit)
    return ""


@dataclass(frozen=True)
class Case:
    send: Callable[[], str]  # returns the task id it used, or ""
    reason: str
    words: str  # must appear in the dead letter's error
    redis_only: bool = False
    amqp_only: bool = False


def _envelope(raw_body: bytes, signed: bool = True, **changes: Any) -> str:
    import base64

    task_id = str(uuid.uuid4())
    headers = {"lang": "py", "task": RELEASE_TASK, "id": task_id, "retries": 0}
    if signed:
        headers.update(signature_for(RELEASE_TASK, task_id, raw_body))
    envelope: dict[str, Any] = {
        "body": base64.b64encode(raw_body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": "cleanup"},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    envelope.update(changes)
    return json.dumps(envelope)


BIG = 2 * 1024 * 1024
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@cache
def _bomb() -> bytes:
    """115 bytes of bz2 that decompress to 128 MiB (kombu decompressed it in the main process)."""
    return bz2.compress(b" " * (128 * 1024 * 1024), 9)


def _from_now(**delta: float) -> str:
    return (datetime.now(UTC) + timedelta(**delta)).isoformat()


CASES: dict[str, Case] = {
    # -- stopped the worker's main process before (Celery/billiard/kombu raised outside a task)
    "unknown task, no id header, body not JSON": Case(
        lambda: publish_raw(b"{not json", task="cleanup.no_such_task", with_id=False),
        "unknown_task",
        "no_such_task",
    ),
    "unknown task, no id header, pickle content type": Case(
        lambda: publish_raw(
            b"\x80\x04K\x01.",
            task="cleanup.no_such_task",
            with_id=False,
            content_type="application/x-python-serialize",
            encoding="binary",
        ),
        "unknown_task",
        "no_such_task",
    ),
    "argument nested 900 deep": Case(
        lambda: publish_raw(f"[[{_nested(900)}], {{}}, {{}}]"), "rejected", "nested deeper"
    ),
    "body nested 100,000 deep": Case(
        lambda: publish_raw(_nested(100_000)), "rejected", "nested deeper"
    ),
    "timelimit header is garbage": Case(
        lambda: publish_raw(_body(_good()), headers={"timelimit": "garbage"}),
        "rejected",
        "timelimit",
    ),
    "timelimit header has strings": Case(
        lambda: publish_raw(_body(_good()), headers={"timelimit": ["a", "b"]}),
        "rejected",
        "timelimit",
    ),
    "eta header is garbage": Case(
        lambda: publish_raw(_body(_good()), headers={"eta": "tomorrow-ish"}), "rejected", "eta"
    ),
    "expires header is garbage": Case(
        lambda: publish_raw(_body(_good()), headers={"expires": {"a": 1}}), "rejected", "expires"
    ),
    "retries header is a string": Case(
        lambda: publish_raw(_body(_good()), headers={"retries": "many"}), "rejected", "retries"
    ),
    "task header is not a string": Case(
        lambda: (
            publish_raw(_body(_good()), task=None, headers={"task": ["x"], "id": "1"}) and ""
        ),  # the id header is the hand-made "1"
        "rejected",
        "task",
    ),
    "2 MB body": Case(lambda: publish_raw(_body(_good(trace_id="x" * BIG))), "rejected", "bytes"),
    # -- left no trace before (acked with only a log line)
    "reservation_id 2**64": Case(
        lambda: publish_raw(_body(_good(rid=2**64))), "malformed", "reservation_id"
    ),
    "version 2**40": Case(lambda: publish_raw(_body(_good(version=2**40))), "malformed", "version"),
    "lone surrogate in trace_id": Case(
        lambda: publish_raw(_body(_good(trace_id="\ud800"))), "malformed", "trace_id"
    ),
    "NUL byte in trace_id": Case(
        lambda: publish_raw(_body(_good(trace_id="a\x00b"))), "malformed", "trace_id"
    ),
    "body is an object with three keys": Case(
        lambda: publish_raw(json.dumps({"args": [_good()], "kwargs": {}, "embed": {}})),
        "rejected",
        "[args, kwargs, embed]",
    ),
    "kwargs is not a mapping": Case(
        lambda: publish_raw(json.dumps([[_good()], [1, 2], {}])),
        "rejected",
        "kwargs",
    ),
    # -- Redis list entries that are not kombu envelopes (stopped the worker inside kombu)
    "redis entry is not JSON": Case(
        lambda: push_redis_entry(b"\xff\xfe not json"), "rejected", "envelope", redis_only=True
    ),
    "redis entry is JSON nested 100,000 deep": Case(
        lambda: push_redis_entry(_nested(100_000)), "rejected", "envelope", redis_only=True
    ),
    "redis entry is a JSON list": Case(
        lambda: push_redis_entry("[1, 2, 3]"), "rejected", "envelope", redis_only=True
    ),
    "redis envelope without properties": Case(
        lambda: push_redis_entry(json.dumps({"body": "e30=", "headers": {}})),
        "rejected",
        "envelope",
        redis_only=True,
    ),
    "redis envelope whose body is not base64": Case(
        lambda: push_redis_entry(_envelope(b"", body="%%% not base64 %%%")),
        "rejected",
        "envelope",
        redis_only=True,
    ),
    # -- passed the screening and did harm (round two): built-in tasks, scheduling, links, limits
    "celery.chord_unlock retrying forever": Case(
        lambda: publish_raw(
            json.dumps([["g", {"task": "cleanup.prune"}], {"interval": 0.5}, _EMBED]),
            task="celery.chord_unlock",
        ),
        "rejected",
        "built-in task 'celery.chord_unlock'",
    ),
    "celery.map around the delivery guard": Case(
        lambda: publish_raw(
            json.dumps([[{"task": RELEASE_TASK}, [[_good()]]], {}, _EMBED]), task="celery.map"
        ),
        "rejected",
        "built-in task 'celery.map'",
    ),
    "eta a day ahead": Case(
        lambda: publish_raw(_body(_good()), headers={"eta": _from_now(days=1), "retries": 1}),
        "rejected",
        "eta is 86400 s ahead",
    ),
    "timelimit above the worker's": Case(
        lambda: publish_raw(_body(_good()), headers={"timelimit": [3600, None]}),
        "rejected",
        "hard limit of 3600",
    ),
    "expires before it was published": Case(
        lambda: publish_raw(_body(_good()), headers={"expires": _from_now(days=-1)}),
        "rejected",
        "expires is earlier",
    ),
    "a link to another task": Case(
        lambda: publish_raw(
            json.dumps([[_good()], {}, {**_EMBED, "callbacks": [{"task": "cleanup.prune"}]}])
        ),
        "rejected",
        "links further tasks (callbacks)",
    ),
    "a header the publisher never sets": Case(
        lambda: publish_raw(_body(_good()), headers={"x-custom": "1"}),
        "rejected",
        "'x-custom' is not one the project's publisher sets",
    ),
    "a group header": Case(
        lambda: publish_raw(_body(_good()), headers={"group": "g1"}),
        "rejected",
        "'group' asks for a Celery feature",
    ),
    "bz2 body that decompresses to 128 MiB": Case(
        lambda: publish_raw(_bomb(), headers={"compression": "application/x-bz2"}),
        "rejected",
        "compressed bodies are refused",
    ),
    # more brackets than the cap (so the nesting scan runs), then an unterminated string
    "near 1 MiB of escaped quotes (quadratic to scan before)": Case(
        lambda: publish_raw(b"[]" * 40 + b'"' + b'\\"' * (500 * 1024)), "rejected", "undecodable"
    ),
    # -- passed the screening and cost memory or trust (round three)
    "content type application/data, encoded bz2": Case(
        lambda: publish_raw(_bomb(), content_type="application/data", encoding="bz2"),
        "rejected",
        "content type 'application/data' is not 'application/json'",
    ),
    "json in another encoding": Case(
        lambda: publish_raw(_body(_good()).encode(), encoding="zlib"),
        "rejected",
        "content encoding 'zlib' is not 'utf-8'",
    ),
    "eta on a first delivery": Case(
        lambda: publish_raw(_body(_good()), headers={"eta": _from_now(seconds=1)}),
        "rejected",
        "eta on a first delivery",
    ),
    "a 700 KB one-hold message": Case(
        lambda: publish_raw(_body(_good(padding="p" * 700_000))),
        "rejected",
        "larger than a message carrying 1 hold(s) needs",
    ),
    "argsrepr of 100 KB": Case(
        lambda: publish_raw(_body(_good()), headers={"argsrepr": "a" * 100_000}),
        "rejected",
        "argsrepr",
    ),
    "redis entry routed to kombu's ack hash": Case(
        lambda: push_redis_entry(
            _envelope(
                _body(_good()).encode(),
                properties={
                    "delivery_info": {"exchange": "", "routing_key": "unacked"},
                    "priority": 0,
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid.uuid4()),
                },
            )
        ),
        "misrouted",
        "misrouted",
        redis_only=True,
    ),
    "a 5 MiB body on RabbitMQ": Case(
        lambda: publish_raw(_body(_good(trace_id="x" * (5 * 1024 * 1024)))),
        "rejected",
        "exceeds CLEANUP_MAX_MESSAGE_BYTES",
        amqp_only=True,
    ),
    # -- spent a real hold's delivery budget (round four): only the project's messages count
    "release message without the project's signature": Case(
        lambda: publish_raw(_body(_good()), signed=False), "unsigned", "not signed"
    ),
    "release message signed for another message": Case(
        lambda: publish_raw(_body(_good()), headers={"cleanup_signature": "0" * 64}),
        "unsigned",
        "does not match",
    ),
    # -- AMQP content headers (stopped the worker inside py-amqp's frame decoding)
    "amqp header table nested 3,000 deep": Case(
        lambda: publish_deep_headers(3000), "rejected", "nested deeper", amqp_only=True
    ),
}


@dataclass(frozen=True)
class Drop:
    """A broadcast (remote-control) message: dropped with a counted metric, no dead letter."""

    send: Callable[[], Any]
    reason: str  # the drop counter's label
    redis_only: bool = False
    amqp_reason: str = ""  # the label on RabbitMQ, when it differs


def _drop_reason(drop: Drop) -> str:
    return drop.reason if settings.BROKER_IS_REDIS else (drop.amqp_reason or drop.reason)


def _app() -> Any:
    """The Celery app, untyped: celery-types lacks the mailbox and kombu's channel details."""
    from config.celery_app import app

    return app


def _control_channel() -> str:
    app = _app()
    with app.connection_for_write() as conn:
        prefix = conn.default_channel.keyprefix_fanout
    return f"{prefix}{app.control.mailbox.exchange.name}"


def _publish_control(body: Any, headers: dict[str, Any] | None = None) -> None:
    app = _app()
    mailbox = app.control.mailbox
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # json writes the 4,000-digit clock only without the cap
    try:
        with app.connection_for_write() as conn:
            conn.Producer().publish(
                body,
                exchange=mailbox.exchange,
                declare=[mailbox.exchange],  # kombu routes by the exchange type it has declared
                routing_key="",
                serializer="json",
                headers=headers,
            )
    finally:
        sys.set_int_max_str_digits(limit)


def _redis_publish(channel: str, data: bytes | str) -> None:
    from cleanup.broker.readers import redis_client

    redis_client().publish(channel, data)


DROPS: dict[str, Drop] = {
    # one PUBLISH stopped every worker at once (kombu's fan-out delivery raised)
    "redis broadcast that is a JSON list": Drop(
        lambda: _redis_publish(_control_channel(), "[]"), "not_an_envelope", redis_only=True
    ),
    "redis broadcast nested 100,000 deep": Drop(
        lambda: _redis_publish(_control_channel(), _nested(100_000)),
        "not_an_envelope",
        redis_only=True,
    ),
    "control body that is a list": Drop(lambda: _publish_control([]), "malformed"),
    "remote shutdown": Drop(lambda: _control("shutdown"), "not_allowed"),
    "remote pool_shrink": Drop(lambda: _control("pool_shrink", n=1), "not_allowed"),
    "reply to another exchange": Drop(
        lambda: _publish_control(
            {"method": "ping", "reply_to": {"exchange": "", "routing_key": "cleanup"}}
        ),
        "malformed",
    ),
    "compressed control message": Drop(lambda: _publish_compressed_control(), "undecodable"),
    # kombu decoded a trusted content type by its content-encoding, bz2 included
    "control message typed application/data, encoded bz2": Drop(
        lambda: _publish_compressed_control(
            content_type="application/data", content_encoding="bz2", headers={}
        ),
        "not_an_envelope",
        amqp_reason="undecodable",
    ),
    # inside the old bound (2**63 - 1): the clock's next step no longer fits an AMQP header's
    # 64-bit integer, every reply failed to encode and ping went silent until a restart
    "control clock at the top of a 64-bit integer": Drop(
        lambda: _publish_control({"method": "ping"}, headers={"clock": 2**63 - 1}), "malformed"
    ),
    # an AMQP routing key holds 255 bytes: the reply could not be published
    "reply routing key of 300 characters": Drop(
        lambda: _publish_control(
            {"method": "ping", "reply_to": _reply_to("r" * 300), "ticket": str(uuid.uuid4())}
        ),
        "malformed",
    ),
    # echoed in the reply's headers, which must fit one AMQP frame
    "reply ticket of 200 KB": Drop(
        lambda: _publish_control(
            {"method": "ping", "reply_to": _reply_to(str(uuid.uuid4())), "ticket": "t" * 200_000}
        ),
        "malformed",
    ),
    "a header kombu's mailbox never sets": Drop(
        lambda: _publish_control({"method": "ping"}, headers={"x-custom": "x" * 1000}),
        "malformed",
    ),
    "an expires header that is not a time": Drop(
        lambda: _publish_control({"method": "ping"}, headers={"expires": "soon"}), "malformed"
    ),
    # kombu's Lamport clock adopted it and every later reply failed to encode
    "control clock of 4,000 digits": Drop(
        lambda: _publish_control({"method": "ping"}, headers={"clock": 10**4000}),
        "malformed",
        redis_only=True,  # an AMQP header table has no integer of that size
    ),
}


def _reply_to(routing_key: str) -> dict[str, str]:
    return {"exchange": _app().control.mailbox.reply_exchange.name, "routing_key": routing_key}


def _control(command: str, **arguments: Any) -> None:
    from config.celery_app import app

    app.control.broadcast(command, arguments=arguments)


def _publish_compressed_control(
    content_type: str = "application/json",
    content_encoding: str = "utf-8",
    headers: dict[str, Any] | None = None,
) -> None:
    app = _app()
    with app.connection_for_write() as conn:
        conn.Producer().publish(
            _bomb(),
            exchange=app.control.mailbox.exchange,
            declare=[app.control.mailbox.exchange],
            routing_key="",
            content_type=content_type,
            content_encoding=content_encoding,
            headers={"compression": "application/x-bz2"} if headers is None else headers,
        )


@pytest.fixture
def metrics_port() -> int:
    return free_port()


def _new_worker(tmp_path: Path, metrics_port: int) -> Worker:
    name = f"hostile-{uuid.uuid4().hex[:6]}"
    env = {"WORKER_METRICS_PORT": str(metrics_port), "WORKER_METRICS_DIR": str(tmp_path / name)}
    return Worker(name, 2, tmp_path / f"{name}.log", env_overrides=env)


def _replace_stopped(tmp_path: Path, metrics_port: int, restarted: list[Worker]) -> Worker:
    """A fresh worker after a case stopped one, on an empty broker (the message would come
    back and stop the next worker too)."""
    purge_broker()
    worker = _new_worker(tmp_path, metrics_port)
    restarted.append(worker.start())
    worker.wait_ready()
    return worker


@pytest.fixture
def hostile_worker(
    clean: None, exclusive_workers: None, tmp_path: Path, metrics_port: int
) -> Iterator[Worker]:
    worker = _new_worker(tmp_path, metrics_port).start()
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.kill()


@pytest.fixture
def restarted() -> Iterator[list[Worker]]:
    """Workers a test had to start again (only when a case stopped one); killed at the end."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def _publish_valid(hold_id: int) -> None:
    expires_at = scalar("SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id])
    publish_release_messages(
        [ReleaseMessage.for_hold(hold_id, 1, expires_at, 0, f"valid-{hold_id}")]
    )


def test_each_hostile_message_is_one_dead_letter_and_the_worker_keeps_releasing(
    hostile_worker: Worker, tmp_path: Path, restarted: list[Worker], metrics_port: int
) -> None:
    # given: one worker, and one valid expired hold per hostile case
    on_redis = settings.BROKER_IS_REDIS
    skip = "amqp_only" if on_redis else "redis_only"
    cases = {name: case for name, case in CASES.items() if not getattr(case, skip)}
    holds = create_eligible_holds(len(cases), offerings=2)
    worker = hostile_worker
    main_pid = worker.pid
    failures: list[str] = []
    stopped: list[str] = []
    for hold_id, (name, case) in zip(holds, cases.items(), strict=True):
        before = DeadLetter.objects.count()
        # when: the hostile message, then a valid one behind it
        task_id = case.send()
        _publish_valid(hold_id)

        # then: the valid hold is released (the worker got past the hostile message) ...
        def released_or_stopped(hold_id: int = hold_id, worker: Worker = worker) -> bool:
            status = scalar("SELECT status FROM reservations_reservation WHERE id = %s", [hold_id])
            return not worker.alive() or status == "released"

        def dead_lettered(before: int = before) -> bool:
            return DeadLetter.objects.count() > before

        try:
            wait_until(released_or_stopped, timeout=45, what=f"the valid hold behind {name!r}")
            if worker.alive():
                wait_until(dead_lettered, timeout=15, what=f"a dead letter for {name!r}")
        except TimeoutError as exc:
            failures.append(f"{name}: {exc}")
            continue
        # ... by the same main process, and exactly one dead letter says why
        if not worker.alive() or worker.pid != main_pid:
            # Say which case stopped it, then carry on with a fresh worker and an empty queue
            # (the message would come back and stop the next worker too).
            stopped.append(name)
            worker = _replace_stopped(tmp_path, metrics_port, restarted)
            main_pid = worker.pid
            continue
        letters = list(DeadLetter.objects.order_by("id")[before:])
        if len(letters) != 1:
            failures.append(f"{name}: {len(letters)} dead letters")
            continue
        letter = letters[0]
        if letter.reason != case.reason or case.words not in letter.error:
            failures.append(f"{name}: got {letter.reason}: {letter.error[:200]!r}")
        if task_id and letter.task_id and letter.task_id != task_id:
            failures.append(f"{name}: dead letter names task {letter.task_id}, sent {task_id}")
        if len(letter.payload) > 8192 or len(json.dumps(letter.message or {})) > 16384:
            failures.append(f"{name}: dead letter stores {len(letter.payload)} payload chars")
    report = [f"stopped the worker's main process: {name}" for name in stopped] + failures
    assert report == [], "\n" + "\n".join(report) + "\n" + worker.log_tail(30)
    # and: nothing but the valid holds was released, each once; seats are conserved
    assert outcome_counts() == {"released": len(holds)}
    assert invariant_violations(expected_released=holds) == []
    assert worker.alive() and worker.pid == main_pid


def test_an_unstorable_message_still_leaves_a_dead_letter_row(hostile_worker: Worker) -> None:
    # given: a malformed release message whose fields PostgreSQL cannot store as they are
    hostile = _good(rid=2**64, version=2**40, trace_id="\ud800\x00" + "y" * 3000)
    hostile["idempotency_key"] = "\x00" * 200
    # when
    publish_raw(_body(hostile))
    # then: a bounded, sanitized row exists and the worker is still up
    letter = wait_until(lambda: DeadLetter.objects.first(), timeout=45, what="a dead letter")
    assert letter.reason == "malformed"
    assert letter.reservation_id is None and letter.version is None
    assert "\x00" not in letter.payload and len(letter.payload) <= 8192
    assert hostile_worker.alive()


def test_hostile_messages_never_count_against_a_real_hold(hostile_worker: Worker) -> None:
    # given: a hold whose key an attacker reuses in messages that fail validation
    hold_id = create_eligible_holds(1, offerings=1)[0]
    for _ in range(5):
        publish_raw(_body(_good(rid=hold_id, trace_id="\x00")))
    wait_until(lambda: DeadLetter.objects.count() == 5, timeout=45, what="five dead letters")
    # when: the real message comes
    _publish_valid(hold_id)
    # then: it is released, not set aside as poison
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the real release")
    # and every message the worker took is finished and acknowledged: a dead letter for any of
    # them is written before its acknowledgement
    wait_until(lambda: queue_settled(cleanup_settings().release_queue), timeout=45,
               what="every delivery acknowledged")  # fmt: skip
    assert DeadLetter.objects.count() == 5


def _ping_answered_by(worker: Worker) -> Callable[[], bool]:
    def answered() -> bool:
        # Celery's "%h" in the worker's name is this host's name; one reply ends the wait
        node = f"{worker.name}@{socket.gethostname()}"
        replies = _app().control.ping(destination=[node], limit=1, timeout=2)
        return any(worker.name in name for reply in replies for name in reply)

    return answered


def _dropped(port: int, reason: str) -> float:
    samples, _ = scrape_worker(port)
    return total(samples, "reservation_cleanup_control_messages_dropped_total", reason=reason)


def test_each_hostile_broadcast_is_dropped_and_counted_and_the_worker_keeps_releasing(
    hostile_worker: Worker, tmp_path: Path, restarted: list[Worker], metrics_port: int
) -> None:
    # given: one worker, and one valid expired hold per hostile broadcast
    drops = {n: d for n, d in DROPS.items() if settings.BROKER_IS_REDIS or not d.redis_only}
    holds = create_eligible_holds(len(drops), offerings=2)
    worker, main_pid = hostile_worker, hostile_worker.pid
    failures: list[str] = []
    for hold_id, (name, drop) in zip(holds, drops.items(), strict=True):
        reason = _drop_reason(drop)
        before = _dropped(metrics_port, reason)
        # when: the broadcast, then a valid release message
        drop.send()
        _publish_valid(hold_id)

        # then: the same main process releases the valid hold and counts exactly one drop
        def released_or_stopped(hold_id: int = hold_id, worker: Worker = worker) -> bool:
            status = scalar("SELECT status FROM reservations_reservation WHERE id = %s", [hold_id])
            return not worker.alive() or status == "released"

        try:
            wait_until(released_or_stopped, timeout=45, what=f"the valid hold after {name!r}")
            if worker.alive():
                wait_until(
                    lambda r=reason, b=before: _dropped(metrics_port, r) > b,  # type: ignore[misc]
                    timeout=15,
                    what=f"a counted drop for {name!r}",
                )
        except TimeoutError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if not worker.alive() or worker.pid != main_pid:
            failures.append(f"{name}: stopped the worker's main process")
            worker = _replace_stopped(tmp_path, metrics_port, restarted)
            main_pid = worker.pid
            continue
        # a later broadcast answered: the main process, which handles broadcasts one after
        # the other, is done with this one and any count it would add
        wait_until(_ping_answered_by(worker), timeout=15, what=f"a ping after {name!r}")
        counted = _dropped(metrics_port, reason) - before
        if counted != 1:
            failures.append(f"{name}: {counted} drops counted")
    assert failures == [], "\n" + "\n".join(failures) + "\n" + worker.log_tail(30)
    # and: no dead letter (a control message names no hold), only the valid holds released
    assert DeadLetter.objects.count() == 0
    assert outcome_counts() == {"released": len(holds)}
    # and: the commands operators use still answer
    replies = _app().control.ping(timeout=3)
    assert any(worker.name in name for reply in replies for name in reply)
    assert worker.alive() and worker.pid == main_pid


def test_a_compressed_body_is_refused_before_it_is_decompressed(hostile_worker: Worker) -> None:
    # given: the worker's main process, its peak memory so far
    hold_id = create_eligible_holds(1, offerings=1)[0]
    peak_before = hostile_worker.memory()["main"]["VmHWM"]
    # when: 115 bytes of bz2 that would decompress to 128 MiB, then a valid message
    publish_raw(_bomb(), headers={"compression": "application/x-bz2"})
    _publish_valid(hold_id)
    # then: one dead letter says why, the valid hold is released, and the main process never
    # held the decompressed body (it grew by ~250 MiB when kombu decompressed it)
    _assert_one_letter_and_no_body_held(
        hostile_worker, peak_before, "compressed bodies are refused", limit_kib=32 * 1024
    )


def _assert_one_letter_and_no_body_held(
    worker: Worker, peak_before: int, reason: str, *, limit_kib: int
) -> None:
    """One dead letter naming ``reason``, the valid hold behind it released, and the worker's
    main process peak memory grown by less than ``limit_kib`` (it never held the body)."""
    letter = wait_until(lambda: DeadLetter.objects.first(), timeout=45, what="a dead letter")
    assert reason in letter.error
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the release")
    grown_kib = worker.memory()["main"]["VmHWM"] - peak_before
    assert grown_kib < limit_kib, f"main process peak grew by {grown_kib} KiB"
    assert DeadLetter.objects.count() == 1


def _protocol_1_body(**fields: Any) -> str:
    """A Celery protocol-1 message body: everything (task name, id, limits) in the body, no
    task headers; Celery's consumer still accepts this format."""
    return json.dumps(
        {"task": RELEASE_TASK, "id": str(uuid.uuid4()), "args": [_good()], "kwargs": {}, **fields}
    )


def test_protocol_1_messages_are_refused_before_celery_reads_their_body(
    hostile_worker: Worker,
) -> None:
    """A Celery protocol-1 message carries its task name and limits in the body, where the
    header checks do not look. Before the consumer refused them, a scalar time limit in such a
    body raised inside Celery's handler in the worker's main process ("cannot unpack"), and a
    protocol-1 built-in task (``celery.chord_unlock``) passed the built-in refusal. The
    project publishes protocol 2 only, so a message without a 'task' header is refused."""
    # given: a valid hold behind the messages
    hold_id = create_eligible_holds(1, offerings=1)[0]
    main_pid = hostile_worker.pid
    # when
    publish_raw(_protocol_1_body(timelimit=5), task=None)
    publish_raw(_protocol_1_body(task="celery.chord_unlock"), task=None)
    _publish_valid(hold_id)
    # then: the worker's main process got past them and released the hold behind them
    wait_until(
        lambda: not hostile_worker.alive() or outcome_counts().get("released") == 1,
        timeout=45,
        what="the valid hold behind the protocol-1 messages",
    )
    assert hostile_worker.alive() and hostile_worker.pid == main_pid, hostile_worker.log_tail(30)
    # and the screening set both aside, each with the reason (not the consumer's catch-all)
    wait_until(lambda: DeadLetter.objects.count() >= 2, timeout=15, what="two dead letters")
    letters = list(DeadLetter.objects.order_by("id"))
    assert [(d.reason, "no 'task' header" in d.error) for d in letters] == [
        ("rejected", True),
        ("rejected", True),
    ], [(d.reason, d.error) for d in letters]
    assert not log_lines([hostile_worker.log_path], "message raised before reaching a task")


def test_a_trusted_content_type_is_never_decoded_by_its_codec(hostile_worker: Worker) -> None:
    """kombu decodes ``application/data`` and ``application/text`` (accepted whatever the
    accept list says) with ``codecs.decode(body, content_encoding)``, and bz2 is a codec: the
    same 115 bytes as above, typed so, grew a worker by its decompressed size, as a task on
    either broker and as one control message on every worker at once."""
    # given
    hold_id = create_eligible_holds(1, offerings=1)[0]
    peak_before = hostile_worker.memory()["main"]["VmHWM"]
    # when: a task message and a control message typed application/data, encoded bz2
    publish_raw(_bomb(), content_type="application/data", encoding="bz2")
    _publish_compressed_control(content_type="application/data", content_encoding="bz2", headers={})
    _publish_valid(hold_id)
    # then: one dead letter, the hold behind them released, and no decompressed body held
    _assert_one_letter_and_no_body_held(
        hostile_worker, peak_before, "application/data", limit_kib=64 * 1024
    )


def test_a_flood_of_large_eta_messages_is_refused_before_it_is_held(hostile_worker: Worker) -> None:
    """150 messages of 700 KB with an eta just inside the bound were all prefetched and held in
    the main process (+345 MB), each then ending as not_found."""
    # given
    hold_id = create_eligible_holds(1, offerings=1)[0]
    peak_before = hostile_worker.memory()["main"]["VmHWM"]
    flood = 40
    # when: a flood of large retries that are due later, then a valid message
    for _ in range(flood):
        publish_raw(
            _body(_good(rid=10**9, padding="p" * 700_000)),
            headers={"eta": _from_now(seconds=1.5), "retries": 1},
        )
    _publish_valid(hold_id)
    # then: each is one dead letter, the valid hold is released, the main process stays small
    wait_until(lambda: DeadLetter.objects.count() >= flood, timeout=90, what="the dead letters")
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the release")
    grown_kib = hostile_worker.memory()["main"]["VmHWM"] - peak_before
    assert grown_kib < 64 * 1024, f"main process peak grew by {grown_kib} KiB"
    assert DeadLetter.objects.count() == flood
    assert {d.reason for d in DeadLetter.objects.all()} == {"rejected"}


def _redelivered_envelope(message: dict[str, Any]) -> str:
    """A valid release message as a Redis list entry, marked as kombu marks a restored one."""
    entry = json.loads(
        _envelope(
            _body(message).encode(),
            properties={
                "delivery_info": {"exchange": "", "routing_key": cleanup_settings().release_queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        )
    )
    entry["headers"].update(redelivered=True, enqueued_at=time.time())
    entry["properties"]["delivery_info"]["redelivered"] = True
    return json.dumps(entry)


@pytest.mark.skipif(not settings.BROKER_IS_REDIS, reason="only a Redis envelope can be forged")
def test_forged_redelivery_marks_never_spend_a_real_holds_budget(
    hostile_worker: Worker, metrics_port: int
) -> None:
    # given: a real hold, not yet expired, and more forged "redelivered" messages for its key
    # than the delivery budget allows
    from reservations import services

    offering = services.create_offering("budget", capacity=1)
    hold = services.hold_seat(offering.pk, "learner", ttl_seconds=3)
    forged = cleanup_settings().max_deliveries + 4
    message = _good(rid=hold.pk, version=hold.version, expires_at=hold.expires_at.isoformat())
    for _ in range(forged):
        push_redis_entry(_redelivered_envelope(message))
    wait_until(
        lambda: _outcomes(metrics_port).get("not_expired", 0) >= forged,
        timeout=45,
        what="the forged messages read",
    )
    # when: the hold expires and its message comes marked as a redelivery (as after a crash)
    wait_until(
        lambda: scalar(
            "SELECT expires_at <= now() FROM reservations_reservation WHERE id = %s", [hold.pk]
        ),
        timeout=10,
        what="the expiry",
    )
    push_redis_entry(_redelivered_envelope(message))
    # then: it is released, not dead-lettered as deliveries_exhausted
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the release")
    assert DeadLetter.objects.count() == 0
    assert hostile_worker.alive()


def test_messages_for_versions_a_hold_never_had_leave_no_receipt(
    hostile_worker: Worker, metrics_port: int
) -> None:
    # given: a real hold at version 1
    hold_id = create_eligible_holds(1, offerings=1)[0]
    before = _outcomes(metrics_port).get("unknown_version", 0)
    # when: valid-looking messages for versions it never had, then its own
    for version in range(1000, 1010):
        publish_raw(_body(_good(rid=hold_id, version=version)))
    _publish_valid(hold_id)
    # then: released once; the forged ones are counted drops with no receipt and no dead letter
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the release")
    wait_until(
        lambda: _outcomes(metrics_port).get("unknown_version", 0) - before >= 10,
        timeout=15,
        what="ten counted drops",
    )
    assert outcome_counts() == {"released": 1}
    assert DeadLetter.objects.count() == 0


def _outcomes(port: int) -> dict[str, float]:
    samples, _ = scrape_worker(port)
    found: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "reservation_cleanup_outcomes_total":
            outcome = dict(labels).get("outcome", "")
            found[outcome] = found.get(outcome, 0.0) + value
    return found


def _set_aside(port: int, key: str) -> float:
    samples, _ = scrape_worker(port)
    return total(samples, "reservation_cleanup_broker_keys_set_aside_total", key=key)


PLANTED_KEYS = {
    "the release queue's key": lambda q: q,
    "a priority sub-key of it": lambda q: f"{q}\x06\x166",
    "kombu's ack hash": lambda q: "unacked",
    "kombu's ack index": lambda q: "unacked_index",
}


@pytest.mark.skipif(not settings.BROKER_IS_REDIS, reason="Redis keys")
def test_each_planted_key_of_the_wrong_type_is_set_aside_and_the_worker_keeps_releasing(
    hostile_worker: Worker, metrics_port: int
) -> None:
    """One SET of a string at a consumed queue's key (or a priority sub-key no operator looks
    at) made every worker exit ("Unrecoverable error ... WRONGTYPE" from BRPOP); at kombu's ack
    hash or index it killed each worker on its next delivery and lost that message."""
    from cleanup.broker import keys
    from cleanup.broker.readers import redis_client

    queue = cleanup_settings().release_queue
    holds = create_eligible_holds(len(PLANTED_KEYS), offerings=2)
    main_pid = hostile_worker.pid
    failures: list[str] = []
    for hold_id, (name, key_of) in zip(holds, PLANTED_KEYS.items(), strict=True):
        key = key_of(queue)
        before = _set_aside(metrics_port, keys.describe(key))
        # when: the key is planted, then a valid message is published
        redis_client().set(key, "planted")
        time.sleep(1.5)  # the worker polls the planted key (BRPOP) before the message comes
        _publish_valid(hold_id)

        def released_or_stopped(hold_id: int = hold_id) -> bool:
            status = scalar("SELECT status FROM reservations_reservation WHERE id = %s", [hold_id])
            return not hostile_worker.alive() or status == "released"

        try:
            wait_until(released_or_stopped, timeout=45, what=f"the release after {name}")
        except TimeoutError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if not hostile_worker.alive() or hostile_worker.pid != main_pid:
            failures.append(f"{name}: stopped the worker's main process")
            break
        if _set_aside(metrics_port, keys.describe(key)) - before != 1:
            failures.append(f"{name}: not counted once as set aside")
        if redis_client().type(key) not in (b"none", b"list", b"hash", b"zset"):
            failures.append(f"{name}: still planted")
    assert failures == [], "\n" + "\n".join(failures) + "\n" + hostile_worker.log_tail(30)
    assert outcome_counts() == {"released": len(holds)}
    assert DeadLetter.objects.count() == 0


@pytest.mark.skipif(not settings.BROKER_IS_REDIS, reason="Redis keys")
def test_a_new_worker_starts_and_releases_over_a_planted_binding_set(
    clean: None, exclusive_workers: None, tmp_path: Path, metrics_port: int, restarted: list[Worker]
) -> None:
    """A string at the exchange's binding set stopped every new worker before it was ready (its
    queue bind raised) and every publish that declared a queue on a fresh connection."""
    from cleanup.broker.readers import redis_client
    from config.celery_app import app as celery_app

    exchange = celery_app.conf.task_default_exchange or celery_app.conf.task_default_queue
    redis_client().set(f"_kombu.binding.{exchange}", "planted")
    hold_id = create_eligible_holds(1, offerings=1)[0]
    # when: a worker starts, and a release is published on a fresh connection
    worker = _new_worker(tmp_path, metrics_port)
    restarted.append(worker.start())
    worker.wait_ready()
    _publish_valid(hold_id)
    # then
    wait_until(lambda: outcome_counts().get("released") == 1, timeout=45, what="the release")
    assert worker.alive()
    assert redis_client().type(f"_kombu.binding.{exchange}") == b"set"


def _release_on_another_queue(hold_id: int, queue: str) -> str:
    """A well-formed release message for a real hold, as the project's publisher writes it,
    on one of the project's other queues: a broker writer's way around the pause."""
    from tests.support.wire import publish_task

    expires_at = scalar("SELECT expires_at FROM reservations_reservation WHERE id = %s", [hold_id])
    message = _good(rid=hold_id, version=1, expires_at=expires_at.isoformat())
    return publish_task(RELEASE_TASK, queue, args=(message,))


def _status(hold_id: int) -> str:
    return str(scalar("SELECT status FROM reservations_reservation WHERE id = %s", [hold_id]))


def test_a_release_read_from_another_queue_never_runs_paused_or_not(
    hostile_worker: Worker,
) -> None:
    """The pause stops the release queue; a valid release message planted on the sweep or
    maintenance queue was consumed there and released its hold while releases were paused."""
    from cleanup.release import pause

    conf = cleanup_settings()
    hold_id, held_back = create_eligible_holds(2, offerings=1)
    main_pid = hostile_worker.pid
    # given: releases paused, and the worker has stopped consuming the release queue
    pause.set_paused(True, "test", "misrouting")
    wait_until(
        lambda: log_lines([hostile_worker.log_path], "releases paused"),
        timeout=15,
        what="the worker to follow the pause",
    )
    # when: the hold's release arrives on the sweep queue, and the release queue gets a real one
    sent = [_release_on_another_queue(hold_id, conf.sweep_queue)]
    _publish_valid(held_back)
    # then: one misrouted dead letter, and nothing released
    try:
        wait_until(lambda: DeadLetter.objects.count() >= 1, timeout=45, what="a dead letter")
        time.sleep(1)  # a release the worker ran would have committed by now
        assert (_status(hold_id), _status(held_back)) == ("held", "held")
    finally:
        # when: the same on the maintenance queue once releases are resumed
        pause.set_paused(False, "test")
    wait_until(lambda: _status(held_back) == "released", timeout=45, what="the resumed release")
    assert _status(hold_id) == "held"
    sent.append(_release_on_another_queue(hold_id, conf.maintenance_queue))
    wait_until(lambda: DeadLetter.objects.count() >= 2, timeout=45, what="a second dead letter")
    # then: each was one misrouted dead letter naming its task, and the hold is still held
    letters = list(DeadLetter.objects.order_by("id"))
    assert [(d.reason, d.task_id) for d in letters] == [("misrouted", t) for t in sent], [
        (d.reason, d.error) for d in letters
    ]
    assert all(conf.release_queue in d.error for d in letters)
    assert _status(hold_id) == "held"
    # and: the same main process still releases that hold when its message comes the right way
    _publish_valid(hold_id)
    wait_until(lambda: _status(hold_id) == "released", timeout=45, what="the real release")
    assert outcome_counts() == {"released": 2}
    assert hostile_worker.alive() and hostile_worker.pid == main_pid
