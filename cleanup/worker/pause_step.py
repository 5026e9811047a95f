"""The workers' side of "pause releases": a consumer bootstep that reads the switch
(cleanup.release.pause) every ``POLL_INTERVAL_S`` seconds in the worker's main
process and stops consuming the release queue while it is on, then consumes it again.

Only the release queue: the sweep and maintenance queues keep being consumed, so sweeps go on
claiming and publishing (until their backpressure cap, as for any backlog), the outbox relay and
the health samples go on, and every gauge keeps showing the backlog growing. Messages a worker
had already fetched are finished; nothing is lost, the queue only waits.

A worker that was not started on the release queue (``-Q sweep``) never starts consuming it. After
a broker reconnection Celery rebuilds the task consumer from the selected queues, which still
leave the release queue out while paused, and the next poll keeps it so. A failed read keeps
whatever the worker is doing: an unreachable database must not resume a paused fleet.

Registered on the apps' Celery app, cleanup/broker/celery_app.py (``app.steps["consumer"]``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

logger = logging.getLogger("cleanup.pause")
# How soon a worker follows the console's switch: one small query per worker instance each time,
# so a paused fleet stops taking releases within a couple of seconds at a negligible cost.
POLL_INTERVAL_S = 2.0


class ReleasePause(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.timer_ref: Any = None
        self.paused = False
        self.owns: bool | None = None  # started on the release queue (decided at first start)

    def start(self, c: Any) -> None:
        from cleanup.conf import cleanup_settings  # noqa: PLC0415 - Django is set up by now

        queue = cleanup_settings().release_queue
        if self.owns is None:
            self.owns = queue in c.app.amqp.queues.consume_from
        if not self.owns:
            return
        self.apply(c)
        self.timer_ref = c.timer.call_repeatedly(POLL_INTERVAL_S, self.apply, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.timer_ref is not None:
            self.timer_ref.cancel()
            self.timer_ref = None

    def apply(self, c: Any) -> None:
        from django.db import close_old_connections  # noqa: PLC0415

        from cleanup.conf import cleanup_settings  # noqa: PLC0415
        from cleanup.release import pause  # noqa: PLC0415

        queue = cleanup_settings().release_queue
        try:
            close_old_connections()
            switch = pause.state()
        except Exception as exc:  # noqa: BLE001 - keep the current state, say why
            logger.warning("release pause: cannot read the switch", extra={"error": repr(exc)})
            close_old_connections()
            return
        if switch.paused and not self.paused:
            c.cancel_task_queue(queue)
            self.paused = True
            logger.warning(
                "releases paused: stopped consuming the release queue",
                extra={"queue": queue, "changed_by": switch.changed_by, "reason": switch.reason},
            )
        elif not switch.paused and self.paused:
            c.add_task_queue(queue)
            self.paused = False
            logger.warning("releases resumed: consuming the release queue", extra={"queue": queue})
