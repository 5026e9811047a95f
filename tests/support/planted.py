"""Broker state as a test plants it in the tests' own Redis database: list entries and
``unacked`` hash values as kombu writes them, good and bad, and the counter of entries the
readers skip."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import pytest
import redis
from django.conf import settings
from prometheus_client import REGISTRY

from cleanup.broker.readers import priority_keys
from cleanup.conf import cleanup_settings
from tests.support.wire import GOOD, RELEASE_TASK, signature_for, task_body

QUEUE = cleanup_settings().release_queue
# Tests of what a Redis broker holds (kombu's lists, its unacked hash): skipped on RabbitMQ.
redis_only = pytest.mark.skipif(not settings.BROKER_IS_REDIS, reason="Redis broker state")
GOOD_AGE = 120.0  # the age of the good entry planted beside the bad ones


def skipped(reader: str) -> float:
    """How many entries ``reader`` skipped so far (``..._broker_entries_skipped_total``)."""
    return (
        REGISTRY.get_sample_value(
            "reservation_cleanup_broker_entries_skipped_total", {"reader": reader}
        )
        or 0.0
    )


def envelope(stamp: Any = None, *, raw_stamp: str | None = None) -> str:
    """A list entry as kombu writes it, with ``enqueued_at`` = ``stamp`` (or the raw JSON text
    ``raw_stamp``: numbers Python cannot write, such as 1e400)."""
    task_id = str(uuid.uuid4())
    headers = {"lang": "py", "task": RELEASE_TASK, "id": task_id, "retries": 0}
    headers.update(signature_for(RELEASE_TASK, task_id, task_body(GOOD)))
    entry = {
        "body": base64.b64encode(task_body(GOOD).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {**headers, "enqueued_at": "@STAMP@"},
        "properties": {
            "delivery_info": {"exchange": "", "routing_key": QUEUE},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    text = json.dumps(entry)
    value = raw_stamp if raw_stamp is not None else json.dumps(stamp)
    return text.replace('"@STAMP@"', value)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


NOW = time.time()

BAD_LIST_ENTRIES: dict[str, Any] = {
    "not JSON": b"\xff\xfe not json",
    "nested 100,000 deep": nested(100_000),
    "a JSON list": "[1, 2, 3]",
    "headers not an object": json.dumps({"headers": "x", "body": ""}),
    "enqueued_at missing": envelope(None),
    "enqueued_at -1e300": envelope(-1e300),
    "enqueued_at -inf": envelope(float("-inf")),
    "enqueued_at NaN": envelope(float("nan")),
    "enqueued_at a string": envelope(str(NOW - 5)),
    "enqueued_at true": envelope(True),
    "enqueued_at 1e300": envelope(1e300),
    "enqueued_at 1e400": envelope(raw_stamp="1e400"),
    "enqueued_at a 400-digit integer": envelope(raw_stamp="1" + "0" * 400),
    "enqueued_at an hour ahead": envelope(NOW + 3600),
    "enqueued_at 1970": envelope(1.0),
}


def unacked_entry(queue: str = QUEUE) -> str:
    """An ``unacked`` hash value as kombu writes it: ``[envelope, exchange, routing_key]``."""
    return json.dumps([json.loads(envelope(NOW - GOOD_AGE)), "", queue])


BAD_UNACKED: dict[str, Any] = {
    "not JSON": b"\xff\xfe not json",
    "nested 100,000 deep": nested(100_000),
    "two elements": json.dumps([{}, ""]),
    "an object of three keys": json.dumps({"a": 1, "b": 2, "c": 3}),
    "routing key not a string": json.dumps([json.loads(envelope(NOW)), "", ["cleanup"]]),
    "message not an envelope": json.dumps([{"body": 1}, "", QUEUE]),
}


def plant_bad_state(client: redis.Redis) -> None:
    """A good waiting message behind a nested-deep oldest entry and one with an absurd stamp;
    a good unacked message beside a nested-deep unacked entry."""
    client.rpush(QUEUE, envelope(time.time() - GOOD_AGE), envelope(-1e300), nested(100_000))
    client.hset("unacked", mapping={"good": unacked_entry(), "bad": nested(100_000)})


def queued_bodies(client: redis.Redis, queue: str) -> list[Any]:
    """The decoded bodies (Celery's [args, kwargs, embed]) of the messages waiting in ``queue``
    (every priority list), oldest first."""
    raw = []
    for key in priority_keys(queue):
        raw.extend(client.lrange(key, 0, -1))
    bodies = []
    for item in reversed(raw):  # LPUSH: the oldest is last
        message = json.loads(item)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        bodies.append(json.loads(body))
    return bodies
