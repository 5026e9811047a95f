"""Publisher confirms' bookkeeping (cleanup.broker.confirms): every publish of the batch's channel
counted, RabbitMQ's answers (one by one, out of order, or ``multiple``) matched against them, a
refusal or silence raised. On a real RabbitMQ refusing a sweep's batch:
tests/integration/test_pipeline_scenarios.py (the RabbitMQ phase); a leader killed mid-drain:
tests/integration/test_rabbitmq_cluster.py."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from cleanup.broker.confirms import ConfirmedBatch, PublishNotConfirmed, confirms_available


class Connection:
    """Reads the answers the test queued, one per ``drain_events``; then silence (a timeout)."""

    def __init__(self) -> None:
        self.answers: list[Callable[[], None]] = []

    def drain_events(self, timeout: float | None = None) -> None:
        if not self.answers:
            raise TimeoutError("timed out")
        self.answers.pop(0)()


class Channel:
    """What of a py-amqp channel the batch uses: its events, confirm mode, publish."""

    def __init__(self) -> None:
        self.events: dict[str, set[Callable[..., None]]] = defaultdict(set)
        self.connection = Connection()
        self.confirm_mode = False
        self.sent: list[Any] = []

    def confirm_select(self) -> None:
        self.confirm_mode = True

    def basic_publish(self, body: Any, **_: Any) -> None:
        self.sent.append(body)

    def answer(self, event: str, tag: int, multiple: bool = False) -> None:
        def deliver() -> None:
            for callback in self.events[event]:
                callback(tag, multiple)

        self.connection.answers.append(deliver)


def batch_of(publishes: int) -> tuple[Channel, ConfirmedBatch]:
    channel = Channel()
    batch = ConfirmedBatch(channel)
    for n in range(publishes):
        channel.basic_publish(n)
    return channel, batch


def test_the_channel_is_put_in_confirm_mode_and_every_publish_on_it_is_counted() -> None:
    channel, batch = batch_of(3)
    assert channel.confirm_mode
    assert (batch.published, channel.sent) == (3, [0, 1, 2])


def test_answers_one_by_one_and_out_of_order_complete_the_batch() -> None:
    channel, batch = batch_of(4)
    for tag in (2, 4, 1, 3):
        channel.answer("basic_ack", tag)
    batch.wait(timeout=1)
    assert batch.confirmed() == 4


def test_one_multiple_answer_covers_every_publish_up_to_it() -> None:
    channel, batch = batch_of(5)
    channel.answer("basic_ack", 4)
    channel.answer("basic_ack", 5, multiple=True)
    batch.wait(timeout=1)
    assert batch.confirmed() == 5


def test_a_refusal_fails_the_batch_naming_how_many() -> None:
    channel, batch = batch_of(5)
    channel.answer("basic_ack", 2, multiple=True)
    channel.answer("basic_nack", 5, multiple=True)
    with pytest.raises(PublishNotConfirmed, match=r"refused 3 of 5 messages \(basic.nack\)"):
        batch.wait(timeout=1)


def test_a_batch_not_answered_in_full_fails_when_the_broker_goes_silent() -> None:
    channel, batch = batch_of(5)
    channel.answer("basic_ack", 1)
    channel.answer("basic_ack", 3)
    with pytest.raises(PublishNotConfirmed, match=r"confirmed 2 of 5 messages within 1s"):
        batch.wait(timeout=1)


def test_a_publish_made_after_some_answers_is_still_waited_for() -> None:
    channel, batch = batch_of(2)
    channel.answer("basic_ack", 2, multiple=True)
    channel.connection.answers.pop(0)()  # read while the batch was still publishing
    channel.basic_publish("late")
    with pytest.raises(PublishNotConfirmed, match="confirmed 2 of 3"):
        batch.wait(timeout=1)


def test_only_an_amqp_channel_has_confirms() -> None:
    from amqp import Channel as AmqpChannel

    assert not confirms_available(Channel())
    assert not confirms_available(object())
    assert confirms_available(AmqpChannel.__new__(AmqpChannel))
