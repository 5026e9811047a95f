"""Celery's native delayed delivery (quorum queues), set up through the node the consumer reached.

With quorum queues a retry's countdown goes through Celery's delayed-delivery exchanges and
queues (cleanup.broker.queues). Celery's ``DelayedDelivery`` consumer step declares them, and
binds the task queues to them, when the consumer starts and again after every reconnection,
through each URL of the broker setting in turn, retrying a URL it cannot reach for about 9 s
(1 + 3 + 5 s) before the next. A RabbitMQ cluster's URL lists every node, so after a node was
lost each consumer waited on the dead node before it consumed again: 17 s without a release in
the cluster drill (tests/integration/test_rabbitmq_cluster.py). The declarations belong to the
cluster, not to a node: this step makes them through a copy of the consumer's own connection,
which has just reached a live node, with Celery's retries and the same functions.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import delayed_delivery as celery_delayed_delivery
from kombu.transport.native_delayed_delivery import (
    declare_native_delayed_delivery_exchanges_and_queues,
)
from kombu.utils.functional import retry_over_time

logger = logging.getLogger("cleanup.delayed_delivery")

CELERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"

# celery-types declares neither the step nor its retry constants.
_celery: Any = celery_delayed_delivery
_DelayedDelivery: Any = _celery.DelayedDelivery


class NodeDelayedDelivery(_DelayedDelivery):
    """Celery's step, with the setup made once per consumer start, through the live node."""

    def start(self, c: Any) -> None:
        self._validate_configuration(c.app)
        try:
            retry_over_time(
                self._setup_through_consumer_node,
                args=(c,),
                catch=_celery.RETRIED_EXCEPTIONS,
                errback=self._on_retry,
                interval_start=_celery.RETRY_INTERVAL,
                max_retries=_celery.MAX_RETRIES,
            )
        except Exception as exc:  # noqa: BLE001 - as Celery's step: the consumer goes on
            # Without the exchanges a retry's countdown message is not routed; its hold comes
            # back through its claim's lease.
            logger.critical("native delayed delivery not set up", extra={"error": repr(exc)[:300]})

    def _setup_through_consumer_node(self, c: Any) -> None:
        with c.connection.clone() as connection:
            declare_native_delayed_delivery_exchanges_and_queues(
                connection, c.app.conf.broker_native_delayed_delivery_queue_type
            )
            self._bind_queues(c.app, connection)
