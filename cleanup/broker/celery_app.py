"""The apps' own Celery app: the cleanup's workers and beat run on it (``celery -A cleanup``),
and every module of the apps that publishes or reads the broker reaches it from here.

A host project keeps its own Celery app, if it has one, beside this one: the delivery policy
(``cleanup.broker.celery_policy``) is this app's and never touches the host's tasks, and this
app is never made the process's current one, so the host's ``shared_task`` calls keep going
through the host's app. The ``CELERY_`` Django settings reach it as they reach any Celery app
(the broker's URL and TLS options, the prefetch, task events); the policy is applied over them
once they are loaded. docs/INTEGRATION.md, "Celery".
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from django.conf import settings as django_settings

from cleanup.broker import celery_policy
from cleanup.conf import cleanup_settings

# Every task publish is checked against the project's own task queues before Celery routes it
# (cleanup.broker.routes): a caller, Flower or a periodic task may not name another key.
app = Celery("reservation-cleanup", amqp="cleanup.broker.routes:ScreenedAMQP", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
# The tasks are this app's own (cleanup.tasks), found when a worker or beat starts.
app.autodiscover_tasks(["cleanup"])
# The operator's "pause releases" switch, followed by every worker (cleanup/worker/pause_step.py).
app.steps["consumer"].add("cleanup.worker.pause_step:ReleasePause")


@app.on_after_configure.connect
def _apply_policy(sender: Celery, source: Any, **_: Any) -> None:
    # The defaults only where the settings say nothing (Celery's add_defaults would rank them
    # above the settings), then the policy over everything.
    for name, value in celery_policy.DEFAULTS.items():
        if not hasattr(django_settings, "CELERY_" + name.upper()):
            source[name] = value
    source.update(
        celery_policy.policy(
            cleanup_settings(),
            str(django_settings.CELERY_BROKER_URL),
            source.broker_transport_options,
        )
    )
    # Read by Celery's Django fixup under this literal name.
    source["CELERY_DB_REUSE_MAX"] = celery_policy.DB_REUSE_MAX


def runs_this_app(sender: Any) -> bool:
    """Whether a worker, beat or consumer signal's sender runs this app: the apps' signal
    handlers leave a host's own workers and beat alone."""
    return getattr(sender, "app", None) is app
