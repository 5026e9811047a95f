"""Release messages as they travel, written out by hand (the tests' own copy of the wire format,
never built by cleanup.release.messages), and publishing anything at all to the release queue, as a
client with write access to the broker could."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cleanup.broker import queues
from cleanup.conf import cleanup_settings

RELEASE_TASK = "cleanup.release_reservation"


def release_message(rid: int = 1, version: int = 1, **changes: Any) -> dict[str, Any]:
    """A valid release message for hold ``rid`` at ``version``, with ``changes`` applied."""
    return {
        "schema_version": 1,
        "reservation_id": rid,
        "version": version,
        "expires_at": "2026-01-01T00:00:00+00:00",
        "idempotency_key": f"release:{rid}:{version}",
        "shard": 0,
        "trace_id": "t",
        **changes,
    }


GOOD = release_message()


def task_body(*args: Any) -> str:
    """A task message body (Celery's protocol 2) with these positional arguments."""
    return json.dumps([list(args), {}, {"callbacks": None, "errbacks": None}])


def signature_for(task: Any, task_id: Any, body: Any) -> dict[str, str]:
    """The project's signature header for a release task message with this body (Celery's
    ``[args, kwargs, embed]`` as JSON), as its publisher would sign it; nothing for another task
    or a body that is not such a list."""
    from cleanup.broker import signing

    if task not in signing.SIGNED_TASKS or not isinstance(task_id, str):
        return {}
    try:
        args, kwargs, *_ = json.loads(body)
        return signing.signed_headers(task_id, task, args, kwargs)
    except (TypeError, ValueError, UnicodeDecodeError, RecursionError):
        return {}


def publish_raw(
    body: Any,
    *,
    task: str | None = RELEASE_TASK,
    headers: dict[str, Any] | None = None,
    with_id: bool = True,
    content_type: str = "application/json",
    encoding: str = "utf-8",
    signed: bool = True,
) -> str:
    """Publish bytes or text as they are to the release queue, with task headers made by hand:
    none when ``task`` is None, no id headers without ``with_id``, ``headers`` laid over them.
    A release message whose body is ``[args, kwargs, embed]`` is signed as the project signs
    its own unless ``signed`` is false, so that what lies behind the signature check is still
    reached. Returns the task id (in the headers when ``with_id``)."""
    from config.celery_app import app

    task_id = str(uuid.uuid4())
    all_headers: dict[str, Any] = {}
    if task is not None:
        # enqueued_at: stamped on every publish by the product's signal handler, so here too
        all_headers = {
            "lang": "py",
            "task": task,
            "retries": 0,
            "origin": "test",
            "enqueued_at": time.time(),
        }
        if with_id:
            all_headers.update(id=task_id, root_id=task_id, parent_id=None)
            if signed:
                all_headers.update(signature_for(task, task_id, body))
    all_headers.update(headers or {})
    with app.connection_for_write() as conn:
        conn.Producer().publish(
            body,
            exchange="",
            routing_key=cleanup_settings().release_queue,
            headers=all_headers,
            content_type=content_type,
            content_encoding=encoding,
        )
    return task_id


def publish_task(
    name: str,
    queue: str,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    expires: float | None = None,
    signed: bool = True,
) -> str:
    """Publish a task message, as Celery writes it, to a queue this process's app does not
    route to: the queues of another deployment (workers started with other ``CLEANUP_*_QUEUE``
    settings), which the app's own ``send_task`` refuses (cleanup.broker.routes); a release
    message signed as the project signs its own unless ``signed`` is false. Returns the task
    id."""
    from datetime import UTC, datetime, timedelta

    from kombu import Queue

    from config.celery_app import app

    task_id = str(uuid.uuid4())
    until = datetime.now(UTC) + timedelta(seconds=expires) if expires is not None else None
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, name, args=args, kwargs=kwargs or {}, expires=until
    )
    headers["enqueued_at"] = time.time()
    if signed:
        headers.update(signature_for(name, task_id, json.dumps([list(args), kwargs or {}])))
    with app.connection_for_write() as conn:
        conn.Producer().publish(
            body,
            exchange="",
            routing_key=queue,
            headers=headers,
            # declared as the deployment's workers declare it (quorum or classic)
            declare=[
                Queue(
                    queue,
                    routing_key=queue,
                    queue_arguments=queues.task_queue_arguments(cleanup_settings()),
                )
            ],
            serializer="json",
            **properties,
        )
    return task_id


def send_signed(app: Any, name: str, args: tuple[Any, ...], **options: Any) -> str:
    """``app.send_task`` as the project's publisher sends a release message: with a task id of
    its own and the project's signature (cleanup.broker.signing). Returns the task id."""
    from cleanup.broker import signing

    task_id = str(uuid.uuid4())
    app.send_task(
        name,
        args=args,
        task_id=task_id,
        headers=signing.signed_headers(task_id, name, args),
        **options,
    )
    return task_id
