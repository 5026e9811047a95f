"""Publisher confirms' bookkeeping (cleanup.broker.confirms): every publish of the batch's channel
counted, RabbitMQ's answers (one by one, out of order, or ``multiple``) matched against them, a
refusal or silence raised; then each publisher into the project's queues (the sweep's fan-out,
beat's send, the outbox relay, a release's retry) in process, on the machine's RabbitMQ in vhosts
of this module's own, refused and accepted. With real workers: tests/integration/
test_pipeline_scenarios.py and test_delivery.py (the RabbitMQ phase); a leader killed mid-drain:
tests/integration/test_rabbitmq_cluster.py."""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from celery.exceptions import Reject, Retry
from django.utils import timezone
from kombu import Producer

from cleanup.broker import confirms
from cleanup.broker.confirms import ConfirmedBatch, PublishNotConfirmed, confirms_available
from cleanup.conf import cleanup_settings
from cleanup.release import outbox
from cleanup.release.messages import ReleaseMessage
from cleanup.release.sweep import sweep_shard
from cleanup.wire import RELEASE_TASK
from config.celery_app import app as celery_app
from reservations import services
from reservations.models import OutboxEvent
from tests.support.fleet import wait_until
from tests.support.holds import claim_counts, due_now, expired_holds
from tests.support.rabbitmq_vhosts import failures, private_vhosts, rabbitmqctl, vhost_url


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


def test_one_message_refused_on_its_own_fails_the_batch() -> None:
    # given: a batch of three, whose middle message the broker refuses alone (not ``multiple``)
    channel, batch = batch_of(3)
    channel.answer("basic_ack", 1)
    channel.answer("basic_nack", 2)
    channel.answer("basic_ack", 3)
    # when: the batch waits for its answers
    # then: the refused message fails the batch (its claim rolls back), though every number
    # was answered: a refusal is no confirmation
    with pytest.raises(PublishNotConfirmed, match=r"refused 1 of 3 messages \(basic.nack\)"):
        batch.wait(timeout=1)


class BusyConnection(Connection):
    """A connection that always has a frame to read (another channel's traffic, heartbeats)
    but never the batch's answers; each read takes a second of a fake clock."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock
        self.reads = 0

    def drain_events(self, timeout: float | None = None) -> None:
        self.reads += 1
        assert self.reads < 100, "the batch kept reading long past its deadline"
        self.clock[0] += 1.0


def test_a_batch_on_a_busy_connection_gives_up_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given: a batch of two whose connection keeps delivering frames, none of them its answers
    clock = [0.0]
    # (the module's clock only: the process's own is left alone)
    monkeypatch.setattr(confirms, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    channel, batch = batch_of(2)
    channel.connection = BusyConnection(clock)
    # when: it waits, for at most 5 seconds
    # then: it fails once they are up (the sweep's row locks are let go), not reading forever
    with pytest.raises(PublishNotConfirmed, match=r"confirmed 0 of 2 messages within 5s"):
        batch.wait(timeout=5)
    assert channel.connection.reads <= 6


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


# --- On a real RabbitMQ: every publisher into the project's queues waits for its confirms ----
#
# The bookkeeping above passes with publishers that never use it. Below, each publisher (the
# sweep's fan-out, beat's send, the outbox relay, a release's retry) runs in process against a
# RabbitMQ of its own: two vhosts of this module, one whose queues take everything and one whose
# queues refuse every publish (an operator's length limit, as the RabbitMQ integration tests set
# it). Only a publish made on a confirm-mode channel and waited for learns of the refusal, so a
# publisher that skips its confirms passes the refusing vhost without a word and fails here.

VHOST_PREFIX = f"reservations-unit-confirms-{os.getpid()}"
REFUSE_EVERYTHING = {"max-length": 0, "overflow": "reject-publish"}
REFUSED = r"RabbitMQ refused \d+ of \d+ messages \(basic.nack\)"


@dataclass
class Vhosts:
    accepting: str
    refusing: str

    def url(self, vhost: str) -> str:
        return vhost_url(vhost)


@pytest.fixture(scope="module")
def vhosts() -> Iterator[Vhosts]:
    """Two vhosts of this module on the machine's RabbitMQ (its own names, deleted afterwards):
    one as it comes, one with a policy that makes every queue in it refuse every publish."""
    hosts = Vhosts(accepting=f"{VHOST_PREFIX}-accepting", refusing=f"{VHOST_PREFIX}-refusing")
    with private_vhosts(hosts.accepting, hosts.refusing):
        refusing = rabbitmqctl(
            ["set_policy", "-p", hosts.refusing, "--apply-to", "queues", "refuse-everything",
             ".*", json.dumps(REFUSE_EVERYTHING)],
        )  # fmt: skip
        assert not failures(refusing), failures(refusing)
        yield hosts


def _channel(connection: kombu.Connection) -> Any:
    """A new channel of ``connection``: py-amqp's, whose queue methods kombu's stubs lack."""
    return connection.channel()


@dataclass
class Broker:
    """A connection to each vhost; ``use`` makes it the one the Celery app publishes on."""

    accepting: kombu.Connection
    refusing: kombu.Connection
    monkeypatch: pytest.MonkeyPatch

    def use(self, connection: kombu.Connection) -> Producer:
        """Make the app's pooled producer (``producer_or_acquire``, where the sweep, the relay
        and a retry take theirs) a producer of ``connection``; returned for beat, which is
        handed its producer."""
        pooled = Producer(connection)

        @contextmanager
        def producer_or_acquire(producer: Any = None) -> Iterator[Any]:
            yield producer if producer is not None else pooled

        self.monkeypatch.setattr(celery_app, "producer_or_acquire", producer_or_acquire)
        return pooled

    def queued(self, queue: str) -> int:
        """Messages waiting in ``queue`` of the accepting vhost."""
        with _channel(self.accepting) as channel:
            return int(channel.queue_declare(queue, passive=True).message_count)


@pytest.fixture
def rabbitmq(vhosts: Vhosts, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    """New connections to the module's vhosts (so kombu declares each queue again), the
    project's queues deleted from both first (each test starts from none)."""
    conf = cleanup_settings()
    with (
        kombu.Connection(vhosts.url(vhosts.accepting)) as accepting,
        kombu.Connection(vhosts.url(vhosts.refusing)) as refusing,
    ):
        for connection in (accepting, refusing):
            with _channel(connection) as channel:
                for queue in (conf.sweep_queue, conf.release_queue, conf.events_queue):
                    channel.queue_delete(queue)
        yield Broker(accepting, refusing, monkeypatch)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("broker")
def test_a_fan_out_rabbitmq_refuses_fails_the_sweep_and_leaves_its_holds_due(rabbitmq):
    # given: expired holds, and a release queue that refuses every publish
    ids = expired_holds(5, name="confirms")
    rabbitmq.use(rabbitmq.refusing)
    # when: a sweep claims them and publishes their messages
    with pytest.raises(PublishNotConfirmed, match=REFUSED):
        sweep_shard(0, 1)
    # then: the claim rolled back with the refusal: no hold is leased without a message
    assert claim_counts(ids) == {0}
    assert due_now(ids) == set(ids)
    # and on a queue that takes them, the next sweep publishes them all, and they are there
    rabbitmq.use(rabbitmq.accepting)
    swept = sweep_shard(0, 1)
    assert (swept.claimed, swept.published) == (5, 5)
    assert claim_counts(ids) == {1}
    release_queue = cleanup_settings().release_queue
    wait_until(lambda: rabbitmq.queued(release_queue) == swept.messages, timeout=10)


@pytest.mark.django_db(transaction=True)
def test_a_beat_send_rabbitmq_refuses_is_logged_and_the_next_one_arrives(
    rabbitmq, leading_beat, caplog
):
    # given: beat holding its lease, the schedule's sweep entry
    scheduler, entry = leading_beat
    options = dict(entry.options)
    # when: beat sends it to a sweep queue that refuses every publish
    with caplog.at_level(logging.ERROR, logger="cleanup.schedule"):
        scheduler.apply_entry(entry, producer=rabbitmq.use(rabbitmq.refusing))
    # then: the refusal is logged, not dropped without a word
    refusals = [r for r in caplog.records if r.getMessage().startswith("beat send not")]
    assert len(refusals) == 1, f"no 'beat send not confirmed' logged; logged: {caplog.text}"
    assert re.search(REFUSED, refusals[0].error), refusals[0].error
    assert entry.options == options  # the entry's own options as they were
    # and when beat sends it to a queue that takes it, it arrives, with nothing logged
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="cleanup.schedule"):
        scheduler.apply_entry(entry, producer=rabbitmq.use(rabbitmq.accepting))
    assert caplog.records == []
    sweep_queue = cleanup_settings().sweep_queue
    wait_until(lambda: rabbitmq.queued(sweep_queue) == 1, timeout=10)
    assert entry.options == options


@pytest.mark.usefixtures("db")
def test_outbox_events_rabbitmq_refuses_stay_unpublished_and_the_next_relay_sends_them(
    rabbitmq,
):
    # given: three domain events waiting in the outbox, and an events queue that refuses all
    offering = services.create_offering("relay", 5)
    hold = services.hold_seat(offering.pk, "a", 60)
    services.renew(hold.pk, 1, 120)
    services.cancel(hold.pk, 2)
    unpublished = OutboxEvent.objects.filter(published_at__isnull=True)
    assert unpublished.count() == 3
    rabbitmq.use(rabbitmq.refusing)
    # when: the relay publishes them
    with pytest.raises(PublishNotConfirmed, match=REFUSED):
        outbox.relay_batch()
    # then: none is marked published (the marks rolled back with the refusal)
    assert unpublished.count() == 3
    # and to a queue that takes them, the next relay sends all three and marks them
    rabbitmq.use(rabbitmq.accepting)
    assert outbox.relay_batch() == 3
    assert unpublished.count() == 0
    events_queue = cleanup_settings().events_queue
    wait_until(lambda: rabbitmq.queued(events_queue) == 3, timeout=10)


@pytest.fixture
def release_delivery(settings: Any) -> Iterator[Any]:
    """The release task as a worker runs it on RabbitMQ: its request is a delivery of the
    release queue (so its retry goes there)."""
    import cleanup.tasks  # noqa: F401  (registers the project's tasks with the app)

    settings.BROKER_IS_REDIS = False
    task = celery_app.tasks[RELEASE_TASK]
    message = ReleaseMessage.for_hold(1, 1, timezone.now(), 0, "confirms").as_dict()
    task.push_request(
        id=f"retry-{uuid.uuid4().hex[:8]}",
        args=[message],
        kwargs={},
        retries=0,
        called_directly=False,
        is_eager=False,
        delivery_info={"exchange": "", "routing_key": cleanup_settings().release_queue},
    )
    try:
        yield task
    finally:
        task.pop_request()


@pytest.mark.usefixtures("broker")
def test_a_retry_rabbitmq_refuses_requeues_the_delivery_and_a_taken_one_arrives(
    rabbitmq, release_delivery, caplog
):
    # given: a release being delivered, whose retry goes to a queue that refuses every publish
    rabbitmq.use(rabbitmq.refusing)
    # when: it retries
    with (
        caplog.at_level(logging.WARNING, logger="cleanup.tasks"),
        pytest.raises(Reject) as rejected,
    ):
        release_delivery.retry(countdown=0)
    # then: the delivery is requeued (Celery would drop it), the refusal said
    reject: Any = rejected.value  # (Celery's stubs lack its attributes)
    assert reject.requeue is True
    assert re.search(REFUSED, str(reject.reason)), reject.reason
    assert "retry not confirmed" in caplog.text
    # and when the queue takes it, the retry is sent: Celery's Retry, the message queued
    rabbitmq.use(rabbitmq.accepting)
    with pytest.raises(Retry):
        release_delivery.retry(countdown=0)
    release_queue = cleanup_settings().release_queue
    wait_until(lambda: rabbitmq.queued(release_queue) == 1, timeout=10)
    with _channel(rabbitmq.accepting) as channel:
        sent = channel.basic_get(release_queue, no_ack=True)
    assert sent.headers["id"] == release_delivery.request.id
    assert sent.headers["retries"] == 1


@pytest.mark.usefixtures("broker")
def test_a_retry_that_cannot_be_sent_requeues_the_delivery(
    rabbitmq, release_delivery, monkeypatch, caplog
):
    # given: a release being delivered, whose retry's message fails to go out (Celery answers
    # such a failure with Reject(requeue=False): the delivery would be dropped, its hold left
    # leased until its claim runs out)
    rabbitmq.use(rabbitmq.accepting)

    def fails(*_args: Any, **_kwargs: Any) -> None:
        raise OSError("the channel broke mid-publish")

    monkeypatch.setattr(Producer, "publish", fails)
    # when: it retries
    with (
        caplog.at_level(logging.WARNING, logger="cleanup.tasks"),
        pytest.raises(Reject) as rejected,
    ):
        release_delivery.retry(countdown=0)
    # then: the delivery is requeued, the failure said
    reject: Any = rejected.value  # (Celery's stubs lack its attributes)
    assert reject.requeue is True, f"the delivery was dropped: {reject!r}"
    assert "the channel broke mid-publish" in str(reject.reason)
    assert "retry not confirmed" in caplog.text
