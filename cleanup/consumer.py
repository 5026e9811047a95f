"""A worker consumer that dead-letters what Celery cannot turn into a task.

- An undecodable body: Celery logs it and acks it, sending no signal (``on_decode_error``);
  this subclass records a dead letter first.
- A body that decodes but has the wrong shape (not ``[args, kwargs, embed]``): Celery's
  request constructor raises, and the exception escapes the consumer and **kills the worker's
  main process** ("Unrecoverable error"); the message then comes back after the visibility
  timeout and kills the next worker. This subclass catches it, dead-letters the message and
  rejects it (no requeue).
Set by the ``worker_consumer`` setting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.worker.consumer import Consumer
from vine import promise

logger = logging.getLogger("cleanup.consumer")

# What a malformed message makes Celery's request constructor raise.
SHAPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, UnicodeError)


class DeadLetteringConsumer(Consumer):  # type: ignore[misc]
    def on_decode_error(self, message: Any, exc: Exception) -> None:
        from .signals import dead_letter_undecodable

        try:
            dead_letter_undecodable(message, exc)
        finally:
            super().on_decode_error(message, exc)

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], Any]:
        handler = super().create_task_handler(promise)

        def on_task_received(message: Any) -> Any:
            try:
                return handler(message)
            except SHAPE_ERRORS as exc:
                from .signals import dead_letter_rejected

                logger.error("message has the wrong shape; dead-lettered", exc_info=True)
                try:
                    dead_letter_rejected(message=message, exc=exc)
                finally:
                    message.reject_log_error(logger, self.connection_errors)  # type: ignore[attr-defined]
                return None

        return on_task_received
