"""Celery signal handlers: stamp ``enqueued_at`` on every publish; dead-letter what never
reaches task code (unknown task names, rejected content)."""

from __future__ import annotations

import time
from typing import Any

from celery.signals import before_task_publish, task_rejected, task_unknown

from .models import DeadLetter


@before_task_publish.connect
def stamp_enqueued_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    # A fresh stamp per publish (retries included): queue age is time spent in this queue.
    if headers is not None:
        headers["enqueued_at"] = time.time()


def _raw(message: Any) -> dict[str, Any]:
    try:
        body = message.body
    except Exception:  # noqa: BLE001
        body = None
    return {
        "headers": getattr(message, "headers", None),
        "content_type": getattr(message, "content_type", None),
        "content_encoding": getattr(message, "content_encoding", None),
        "delivery_info": getattr(message, "delivery_info", None),
        "body": body.decode("utf-8", "replace") if isinstance(body, bytes) else body,
    }


@task_unknown.connect
def dead_letter_unknown_task(
    message: Any = None, exc: Any = None, name: str = "", id: str = "", **_: Any
) -> None:
    from . import deadletters

    deadletters.record(
        DeadLetter.Reason.UNKNOWN_TASK,
        error=f"no task named {name!r} is registered",
        task_name=str(name)[:200],
        task_id=str(id or "")[:64],
        payload=_raw(message),
    )


@task_rejected.connect
def dead_letter_rejected(message: Any = None, exc: Any = None, **_: Any) -> None:
    from . import deadletters

    deadletters.record(
        DeadLetter.Reason.REJECTED,
        error=repr(exc) if exc is not None else "message is not a task message",
        task_name=str((getattr(message, "headers", None) or {}).get("task", ""))[:200],
        task_id=str((getattr(message, "headers", None) or {}).get("id", ""))[:64],
        payload=_raw(message),
    )


def dead_letter_undecodable(message: Any, exc: BaseException) -> None:
    from . import deadletters

    deadletters.record(
        DeadLetter.Reason.REJECTED,
        error=f"undecodable message: {exc!r}",
        task_name=str((getattr(message, "headers", None) or {}).get("task", ""))[:200],
        task_id=str((getattr(message, "headers", None) or {}).get("id", ""))[:64],
        payload=_raw(message),
    )
