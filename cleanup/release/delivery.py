"""The delivery policy of every cleanup task (``CleanupTask``, their Celery base class).

It bounds every loop before any work runs: deliveries per idempotency key are counted outside
the task's transaction, and a message delivered more than ``CLEANUP_MAX_DELIVERIES`` times (one
that kills its worker, say) is dead-lettered instead of being run again. An argument list that
does not fit the task is dead-lettered as malformed, as is a message that fails validation and a
failure that outlasts the retries. Release tasks retry transient errors with backoff
(``RELEASE_TASK_OPTIONS``).
"""

from __future__ import annotations

import inspect
import logging
import socket
import time
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError, close_old_connections, connection

from cleanup import metrics
from cleanup.broker import celery_policy, queues, signing
from cleanup.broker.confirms import PublishNotConfirmed, confirmed_producer
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import dead_letters, delivery_cap
from cleanup.release.messages import (
    BATCH_KIND,
    BatchMessage,
    MalformedMessage,
    validate_batch,
)
from cleanup.release.release import Attempt
from reservations.services import TransientConflict

# The tasks' logger: operators' filters and alerts name it.
logger = logging.getLogger("cleanup.tasks")

# Errors worth another try: connection lost, deadlock, serialization failure, lock timeout
# (psycopg raises them as OperationalError subclasses), and a row that changed mid-decision.
TRANSIENT_ERRORS = (OperationalError, InterfaceError, TransientConflict)
HOSTNAME = socket.gethostname()


def queue_age(request: Any) -> float | None:
    headers = getattr(request, "headers", None) or {}
    stamp = headers.get("enqueued_at") or getattr(request, "enqueued_at", None)
    try:
        return max(0.0, time.time() - float(stamp)) if stamp is not None else None
    except (TypeError, ValueError):
        return None


class RetryNotSent(Exception):
    """Celery could not send a retry's message (it says so with ``Reject(requeue=False)``)."""


class CleanupTask(Task):  # type: ignore[misc]
    """Bounds deliveries and contains bad input for every cleanup task.

    A task's final failure is dead-lettered before the message is acknowledged. When the letter
    cannot be stored (the database is down), the message is sent again after the longest
    backoff instead of being lost with its letter; the delivery count
    (``CLEANUP_MAX_DELIVERIES``) bounds that loop. A periodic task (``periodic = True``:
    sweeps, relay, prune, health upkeep) is sent again at its next beat tick, so its failure is
    a ``periodic_failed`` letter that the task's next success settles, and its message is never
    kept.
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    periodic = False

    def periodic_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Which periodic run this is: the task and its arguments (a sweep's shard and N), so
        that a success settles the failures of the same run only."""
        parts = [*(str(a) for a in args), *(f"{k}={kwargs[k]}" for k in sorted(kwargs))]
        return f"{dead_letters.PERIODIC_KEY_PREFIX}{self.name}:{','.join(parts)}"

    def delivery_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The key this message's deliveries count under: a release message's key
        (``delivery_cap.message_key``); any other task's own id, whatever its arguments say, so
        that no other task's message can spend a hold's budget (``delivery_cap.restored_key``)."""
        if self.name not in signing.SIGNED_TASKS:
            return f"task:{self.request.id or ''}"
        message = args[0] if args else kwargs.get("message")
        return delivery_cap.message_key(message, self.request.id or "")

    def _signature(self) -> inspect.Signature:
        # Computed once per task: inspect.signature costs more than the bind itself.
        found: inspect.Signature | None = self.__dict__.get("_run_signature")
        if found is None:
            found = self.__dict__["_run_signature"] = inspect.signature(self.run)
        return found

    def count_delivery(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """This delivery's number among its key's deliveries (1 for a first delivery).

        Only a redelivery or a retry can be part of a loop. Each is counted where it is made
        (cleanup.release.delivery_cap): kombu's Redis restore and the project's retry count as
        they send the message again, so here a message that says it is one only reads the
        count; RabbitMQ's ``redelivered`` is the broker's own word, in the delivery itself, and
        is counted here. A redelivery from a quorum queue carries the broker's count of the
        message's earlier deliveries (``x-delivery-count``): that count is used as it is, with
        no round trip for a message that was never retried (a retry's redelivery adds the
        retries counted under its key). A first delivery costs no round trip. The count then
        includes the first delivery, which was not counted."""
        redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
        if not redelivered and not self.request.retries:
            return 1
        broker_count = (
            queues.broker_delivery_count(vars(self.request), redelivered)
            if queues.is_quorum(cleanup_settings())
            else None  # a classic queue's header would be the publisher's
        )
        if broker_count is not None and not self.request.retries:
            return broker_count + 1
        key = self.delivery_key(args, kwargs)
        try:
            if broker_count is not None:
                return delivery_cap.current(key) + broker_count + 1
            if redelivered and not celery_policy.broker_is_redis():
                return delivery_cap.increment(key) + 1
            return delivery_cap.current(key) + 1
        except Exception:  # the counter is a guard, not a dependency
            logger.exception("delivery counter unavailable", extra={"key": key})
            return 0

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry (autoretry's included), with the retry counted as it is sent: the
        delivery it makes reads the count instead of trusting its own ``retries`` header."""
        if not self.request.called_directly:
            key = self.delivery_key(tuple(self.request.args or ()), dict(self.request.kwargs or {}))
            try:
                delivery_cap.increment(key)
            except Exception:  # the counter is a guard, not a dependency
                logger.exception("delivery counter unavailable", extra={"key": key})
            if self.name in signing.SIGNED_TASKS:
                # The retry is the same message again (id and arguments), signed as the
                # publisher signs it: the worker that takes it verifies the signature.
                task_args = kwargs.get("args", args[0] if args else None)
                task_kwargs = kwargs.get("kwargs", args[1] if len(args) > 1 else None)
                kwargs["headers"] = {
                    **(kwargs.get("headers") or {}),
                    **signing.signed_headers(
                        self.request.id or "",
                        self.name,
                        tuple(self.request.args or ()) if task_args is None else task_args,
                        dict(self.request.kwargs or {}) if task_kwargs is None else task_kwargs,
                    ),
                }
        if (
            celery_policy.broker_is_redis()
            or self.request.called_directly
            or self.request.is_eager
            or "producer" in kwargs
        ):
            return super().retry(*args, **kwargs)
        with self.app.producer_or_acquire() as pooled:
            return self._confirmed_retry(pooled, args, kwargs)

    def _confirmed_retry(self, pooled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """On RabbitMQ, the retry's message is sent on a new channel in confirm mode and this
        delivery is let go only once the broker has it (cleanup.broker.confirms says why a
        pooled channel is not enough: after a node's death it can lose every retry). A retry
        the broker refused, did not answer for, or that could not be sent, requeues this
        delivery instead (Celery would drop it: ``Reject(requeue=False)``); the delivery cap
        still ends a message that can never be retried."""
        sent: Retry | None = None
        try:
            with confirmed_producer(pooled) as producer:
                try:
                    return super().retry(*args, producer=producer, retry=False, **kwargs)
                except Retry as retry:
                    sent = retry  # the retry's message is out: waited for when the block ends
                except Reject as reject:  # Celery's word for a retry it could not send
                    raise RetryNotSent(repr(reject.args[:1])) from reject
        except (PublishNotConfirmed, RetryNotSent, *pooled.connection.connection_errors) as exc:
            logger.warning(
                "retry not confirmed by the broker; the delivery is requeued",
                extra={"task": self.name, "task_id": self.request.id, "error": repr(exc)[:300]},
            )
            raise Reject(f"retry not confirmed: {exc!r}", requeue=True) from exc
        raise sent

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:
            return super().__call__(*args, **kwargs)
        metrics.record_delivery(self.name)
        try:
            self._signature().bind(*args, **kwargs)
        except TypeError as exc:
            dead_letters.record(
                DeadLetter.Reason.MALFORMED,
                error=f"arguments do not fit {self.name}: {exc}",
                task_name=self.name,
                task_id=self.request.id or "",
                payload={"args": args, "kwargs": kwargs},
            )
            metrics.record_outcome("malformed", None, None)
            return {"outcome": "malformed"}
        count = self.count_delivery(args, kwargs)
        self.request.delivery_count = count  # type: ignore[attr-defined]
        if count > cleanup_settings().max_deliveries:
            message = args[0] if args and isinstance(args[0], dict) else None
            _dead_letter_each_hold(
                DeadLetter.Reason.DELIVERIES_EXHAUSTED,
                error=f"delivered {count} times (limit {cleanup_settings().max_deliveries})",
                task_name=self.name,
                task_id=self.request.id or "",
                message=message,
                payload=None if message else {"args": args, "kwargs": kwargs},
                delivery_count=count,
            )
            for _ in range(_holds_named(message)):
                metrics.record_outcome("dead_lettered", None, None)
            return {"outcome": "dead_lettered"}
        try:
            return super().__call__(*args, **kwargs)
        except (Retry, Reject, Ignore):
            raise  # not a failure: Celery's own control flow
        except Exception as exc:
            # The final failure (autoretry re-raises once the retries are spent): its letter is
            # written here, before Celery acknowledges the message, so that a letter the
            # database refuses can still keep the message.
            if self._dead_letter_failure(exc, args, kwargs) is None and not self.periodic:
                self._keep_message(exc)
            raise

    def _keep_message(self, exc: Exception) -> None:
        """The failure's dead letter could not be stored (the database is down): acknowledging
        now would lose both the message and the evidence. Send it again instead, as a retry
        after the longest backoff (below the visibility timeout), with the same id and
        arguments. Each such delivery counts against ``CLEANUP_MAX_DELIVERIES``, which ends
        the loop if the database stays down (a release's hold then comes back through its
        claim lease)."""
        retries = self.request.retries or 0
        logger.error(
            "dead letter not stored: message sent again",
            extra={
                "task": self.name,
                "task_id": self.request.id,
                "retries": retries,
                "error": repr(exc)[:300],
            },
        )
        raise self.retry(
            exc=exc, countdown=cleanup_settings().retry_backoff_max, max_retries=retries + 1
        )

    def _dead_letter_failure(
        self, exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> DeadLetter | None:
        if self.periodic:
            reason = DeadLetter.Reason.PERIODIC_FAILED
        elif isinstance(exc, TRANSIENT_ERRORS):
            reason = DeadLetter.Reason.RETRIES_EXHAUSTED
        elif isinstance(exc, SoftTimeLimitExceeded):
            reason = DeadLetter.Reason.TIME_LIMIT
        else:
            reason = DeadLetter.Reason.FAILED
        message = args[0] if args and isinstance(args[0], dict) else None
        # The failing connection may be the reason; write the dead letter on a fresh one.
        _reset_connection_on_failure(exc)
        return _dead_letter_each_hold(
            reason,
            error=repr(exc)[:4000],
            task_name=self.name,
            task_id=self.request.id or "",
            message=message,
            payload=None if message else {"args": args, "kwargs": kwargs},
            delivery_count=getattr(self.request, "delivery_count", 0) or 0,
            idempotency_key=self.periodic_key(args, kwargs) if self.periodic else "",
        )

    def on_retry(
        self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        _reset_connection_on_transient(exc)
        metrics.record_retry(self.name)
        logger.warning(
            "transient failure, retrying",
            extra={"task": self.name, "task_id": task_id, "error": repr(exc)[:300]},
        )

    def on_failure(
        self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        # The dead letter was written in __call__, before the acknowledgement: one outcome per
        # hold it named.
        for _ in range(_holds_named(args[0] if args else None)):
            metrics.record_outcome("dead_lettered", None, None)

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        if not self.periodic:
            return
        if isinstance(retval, dict) and retval.get("skipped_locked"):
            return  # another sweep of the shard is running: this one proved nothing
        try:
            dead_letters.resolve_periodic(self.periodic_key(tuple(args), dict(kwargs)))
        except Exception:  # the run succeeded; its next success settles the letters
            logger.exception("periodic dead letters not settled", extra={"task": self.name})

    # --- what a release task's body calls -------------------------------------------------

    def attempt(self, queue_age_seconds: float | None) -> Attempt:
        """This delivery as a release attempt (its number counts from 1)."""
        return Attempt(
            attempt=(self.request.retries or 0) + 1,
            worker=self.request.hostname or HOSTNAME,
            task_id=self.request.id or "",
            queue_age_seconds=queue_age_seconds,
        )

    def dead_letter_malformed(
        self, exc: MalformedMessage, message: Any, age: float | None
    ) -> dict[str, Any]:
        """A message that failed validation as a whole: one letter, one malformed outcome."""
        dead_letters.record(
            DeadLetter.Reason.MALFORMED,
            error=str(exc),
            task_name=self.name,
            task_id=self.request.id or "",
            payload=message,
            message=message if isinstance(message, dict) else None,
            delivery_count=getattr(self.request, "delivery_count", 0) or 0,
        )
        metrics.record_outcome("malformed", None, age)
        return {"outcome": "malformed", "reason": str(exc)}

    def dead_letter_rejected(self, batch: BatchMessage, age: float | None) -> None:
        """A batch's malformed items: one letter and one malformed outcome for each of them;
        the batch's valid holds are released as usual."""
        for item, reason in batch.rejected:
            dead_letters.record(
                DeadLetter.Reason.MALFORMED,
                error=reason,
                task_name=self.name,
                task_id=self.request.id or "",
                payload=item,
                message=item if isinstance(item, dict) else None,
                trace_id=batch.trace_id,
            )
            metrics.record_outcome("malformed", None, age)


def _reset_connection_on_failure(exc: BaseException) -> None:
    """Before the dead letter: drop connections that are unusable (a transient error may have
    been the connection itself)."""
    try:
        close_old_connections()
        if isinstance(exc, TRANSIENT_ERRORS):
            connection.close()
    except Exception:  # noqa: BLE001 - closing a dead connection may raise; it is closed
        pass


def _batch_items(message: Any) -> tuple[Any, ...]:
    """The valid items of a release batch message; () for anything else."""
    if not isinstance(message, dict) or message.get("kind") != BATCH_KIND:
        return ()
    try:
        return validate_batch(message).items
    except MalformedMessage:
        return ()


def _holds_named(message: Any) -> int:
    """How many holds a failed message's dead letters name (at least one letter)."""
    return max(1, len(_batch_items(message)))


def _dead_letter_each_hold(
    reason: str, *, message: dict[str, Any] | None, **fields: Any
) -> DeadLetter | None:
    """Dead-letter a message that failed as a whole. A release batch becomes one letter per
    hold, each naming its hold and carrying that hold's own release message, so each is
    settled by its key's later release, or requeued, on its own (as in the per-reservation
    mode); its malformed items were lettered when it was read. Anything else is one letter.
    Returns the last letter, or None when any of them could not be stored."""
    items = _batch_items(message)
    if not items:
        return dead_letters.record(reason, message=message, **fields)
    stored: DeadLetter | None = None
    missing = False
    for item in items:
        stored = dead_letters.record(reason, message=item.as_dict(), **fields)
        missing = missing or stored is None
    return None if missing else stored


def _reset_connection_on_transient(exc: BaseException) -> None:
    """After a lost connection Django's handle is unusable; drop it so a retry reconnects."""
    if isinstance(exc, OperationalError | InterfaceError):
        try:
            connection.close()
        except Exception:  # noqa: BLE001
            pass


# Release tasks: transient errors retry with exponential backoff and full jitter (uniform in
# [0, min(backoff_max, 2**n)]), capped below the visibility timeout (settings check it).
RELEASE_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "base": CleanupTask,
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": True,
    "retry_backoff_max": cleanup_settings().retry_backoff_max,
    "retry_jitter": True,
    "max_retries": cleanup_settings().max_retries,
}
