"""Publishing cleanup messages: a leaf module, so the sweep, the dead-letter requeue and the
drills publish without importing the task module (which imports them).

Messages are sent by task name on one producer connection; routing follows settings
(``CLEANUP_*_QUEUE``). Each release message is signed (``cleanup.broker.signing``). The
``before_task_publish`` handler (``cleanup.worker.signals``) stamps ``enqueued_at`` on each, as
for any task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kombu.utils.uuid import uuid

from cleanup.broker import signing
from cleanup.broker.celery_app import app
from cleanup.broker.confirms import confirmed_producer, confirms_available
from cleanup.conf import cleanup_settings
from cleanup.release.messages import BatchMessage, ReleaseMessage
from cleanup.wire import RELEASE_BATCH_TASK, RELEASE_TASK, SWEEP_TASK

# The task that reads each kind of message.
TASK_OF: dict[type[ReleaseMessage | BatchMessage], str] = {
    ReleaseMessage: RELEASE_TASK,
    BatchMessage: RELEASE_BATCH_TASK,
}
# Redis commands per pipelined round trip when publishing a fan-out (one LPUSH per message):
# enough that the round trips stop mattering (measured: docs/PERFORMANCE.md).
PUBLISH_PIPELINE = 100


def publish_release_messages(messages: Sequence[ReleaseMessage | BatchMessage]) -> None:
    """Publish release messages on one producer connection (the sweep's fan-out), each as its
    ``as_dict()`` to the task of its type: a ``BatchMessage`` to the batched task.

    On Redis, pipelined: kombu's ``Producer.batch`` (kombu 5.7) buffers the commands and sends
    them in one round trip per ``PUBLISH_PIPELINE`` commands, instead of one LPUSH round trip
    (and one client) per message; every push is answered. On RabbitMQ, confirmed: the messages
    go out on a channel in confirm mode and this returns once the broker has taken every one
    (``cleanup.broker.confirms``). If this raises, messages not yet flushed or confirmed may be
    lost; the sweep publishes inside its claim's transaction, so the claim rolls back and those
    holds are due again at once.
    """
    if not messages:
        return
    queue = cleanup_settings().release_queue
    with app.producer_or_acquire() as producer:
        if confirms_available(producer.channel):
            with confirmed_producer(producer) as confirming:
                for message in messages:
                    send_release(message, queue, confirming, retry=False)
            return
        with producer.batch(max_size=PUBLISH_PIPELINE):
            for message in messages:
                send_release(message, queue, producer)


def send_release(
    message: ReleaseMessage | BatchMessage, queue: str, producer: Any, **options: Any
) -> None:
    """Send one release message to the task of its type on ``producer``, signed
    (``cleanup.broker.signing``: a worker runs and counts only release messages the project
    published)."""
    name, task_id, args = TASK_OF[type(message)], uuid(), (message.as_dict(),)
    app.send_task(
        name,
        args=args,
        task_id=task_id,
        headers=signing.signed_headers(task_id, name, args),
        queue=queue,
        producer=producer,
        **options,
    )


def send_sweep(shard: int, shards: int, **options: Any) -> None:
    """One sweep of ``shard`` of ``shards``, as beat sends it (options: ``expires``, …)."""
    app.send_task(
        SWEEP_TASK,
        kwargs={"shard": shard, "shards": shards},
        queue=options.pop("queue", cleanup_settings().sweep_queue),
        **options,
    )
