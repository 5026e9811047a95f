"""A worker consumer that dead-letters messages Celery could not decode.

Celery acks an undecodable message after logging it and sends no signal
(``Consumer.on_decode_error``); this subclass records it first. Set by ``worker_consumer``.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer


class DeadLetteringConsumer(Consumer):  # type: ignore[misc]
    def on_decode_error(self, message: Any, exc: Exception) -> None:
        from .signals import dead_letter_undecodable

        try:
            dead_letter_undecodable(message, exc)
        finally:
            super().on_decode_error(message, exc)
