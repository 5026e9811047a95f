"""Publisher confirms for the sweep's fan-out on RabbitMQ: a batch is published, then the sweep
waits until the broker has taken every message of it, before its claim commits.

An AMQP ``basic.publish`` gets no reply. Without confirms, a message the node had not yet
replicated (quorum queue) or written (classic queue) when it died is gone, and the publisher
never knows: its hold comes back only when its claim's lease runs out. With confirms, the
broker acknowledges each message once its queue has it (for a quorum queue: once a majority of
the replicas have it), or refuses it (``basic.nack``). The sweep publishes inside its claim's
transaction, so a batch that is not confirmed in full raises here, the claim rolls back and
the holds are due again at once, as for any failed publish.

Only the sweep's batches wait: they run on a channel of their own, opened for the batch and put
in confirm mode there. The connection's other channels (task events, retries, results) stay as
they are: kombu's ``confirm_publish`` transport option would make every publish of a process
wait for its own acknowledgement, a round trip per message, the worker's included. Here the
batch is streamed and the acknowledgements (which RabbitMQ sends for several messages at once,
``multiple``) are read after the last publish: about one round trip and one replication per
batch (measured: docs/PERFORMANCE.md).

Publishes through this channel are made without kombu's retry: a connection lost mid-batch
raises instead of reconnecting and going on, unconfirmed, on a channel of the new connection.

The other publishers into the project's queues use a new confirm-mode channel too, for the same
reason and one more: beat's sends (``cleanup.release.schedule``), the outbox relay's batches
(``cleanup.release.outbox``) and a release's retry (``cleanup.release.delivery``). RabbitMQ
3.10 keeps, per channel and quorum queue, the queue
leader it found at that channel's first publish to the queue. A channel whose first publish
comes while the queue's leader has just died (between the node's death and the election of a
new leader, a fraction of a second) keeps the dead leader: it refuses every later publish to
that queue (``basic.nack``), or without confirm mode drops it without a word, until that node
is back; a new channel publishes normally (docs/TOPOLOGIES.md, "A channel that keeps a dead
leader"). A long-lived channel was how beat lost every sweep after a failover while the
workers, the queues and the other queues were fine. A channel per send costs beat three round
trips (open, confirm.select, close) a few times a second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import amqp
from kombu import Producer

# How long a batch may wait for its acknowledgements. A quorum queue that has lost its majority
# neither acknowledges nor refuses; the claim's row locks are held meanwhile.
CONFIRM_TIMEOUT_SECONDS = 10.0


class PublishNotConfirmed(Exception):
    """The broker did not take every message of a batch: refused some, or did not answer."""


def confirms_available(channel: object) -> bool:
    """Whether ``channel`` speaks AMQP 0-9-1 (RabbitMQ): publisher confirms exist there only.
    Redis answers every push anyway (the pipeline's replies)."""
    return isinstance(channel, amqp.Channel)


class ConfirmedBatch:
    """The acknowledgements of one channel in confirm mode, counted against its publishes.

    RabbitMQ numbers a confirm-mode channel's publishes 1, 2, … and acknowledges (or refuses)
    each number once, alone or as every number up to it (``multiple``), in any order."""

    def __init__(self, channel: Any) -> None:  # an amqp.Channel (its stubs lack ``events``)
        self.channel = channel
        self.published = 0
        self._all_up_to = 0  # every number up to this one is acknowledged
        self._singles: set[int] = set()  # acknowledged one by one above it
        self.refused = 0
        # Count every publish of the channel, not the caller's messages: Celery may publish more
        # than one message per task sent on it (its ``task-sent`` event, with the producer).
        publish = channel.basic_publish

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = publish(*args, **kwargs)
            self.published += 1
            return result

        channel.basic_publish = counted
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.confirm_select()

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        if multiple:
            self._all_up_to = max(self._all_up_to, delivery_tag)
            self._singles = {tag for tag in self._singles if tag > self._all_up_to}
        elif delivery_tag > self._all_up_to:
            self._singles.add(delivery_tag)
        while self._all_up_to + 1 in self._singles:
            self._all_up_to += 1
            self._singles.discard(self._all_up_to)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        # a refused number is answered, so it counts as done; the batch still fails
        if multiple:
            unanswered = range(self._all_up_to + 1, delivery_tag + 1)
            self.refused += sum(1 for tag in unanswered if tag not in self._singles)
        elif delivery_tag > self._all_up_to and delivery_tag not in self._singles:
            self.refused += 1
        self._on_ack(delivery_tag, multiple)

    def confirmed(self) -> int:
        """How many of the publishes have been acknowledged or refused."""
        return self._all_up_to + len(self._singles)

    def wait(self, timeout: float = CONFIRM_TIMEOUT_SECONDS) -> None:
        """Read the channel's connection until every publish is answered; raise
        ``PublishNotConfirmed`` if any was refused or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        connection = self.channel.connection
        while self._all_up_to < self.published and not self.refused:
            left = deadline - time.monotonic()
            if left <= 0 or connection is None:
                break
            try:
                connection.drain_events(timeout=left)
            except TimeoutError:
                break
        if self.refused:
            raise PublishNotConfirmed(
                f"RabbitMQ refused {self.refused} of {self.published} messages (basic.nack)"
            )
        if self._all_up_to < self.published:
            raise PublishNotConfirmed(
                f"RabbitMQ confirmed {self.confirmed()} of {self.published} messages within "
                f"{timeout:g}s"
            )


@contextmanager
def confirmed_channel(connection: Any) -> Iterator[ConfirmedBatch]:
    """A new channel of ``connection`` (a kombu connection to RabbitMQ) in confirm mode, for the
    caller to publish on (``batch.channel``). On leaving without an error, every publish made on
    it must be confirmed (else ``PublishNotConfirmed``). The channel is closed either way."""
    channel = connection.channel()
    try:
        batch = ConfirmedBatch(channel)
        yield batch
        batch.wait()
    finally:
        try:
            channel.close()
        except Exception:  # noqa: BLE001 - a channel of a lost connection is gone already
            pass


@contextmanager
def confirmed_producer(producer: Any) -> Iterator[Any]:
    """On RabbitMQ, a producer on a new confirm-mode channel of ``producer``'s connection
    (``confirmed_channel``): every publish made through it is confirmed when the block ends, or
    ``PublishNotConfirmed`` is raised. Publish through it with ``retry=False``. Elsewhere
    (Redis answers every push) ``producer`` itself.

    (Reading ``producer.channel`` connects a pooled connection not yet connected; a connection
    known to be lost connects again, through the next URL of a failover list, when the new
    channel is opened; one lost without a word yet fails there and is found lost.)"""
    if not confirms_available(producer.channel):
        yield producer
        return
    with confirmed_channel(producer.connection) as batch:
        yield Producer(batch.channel)
