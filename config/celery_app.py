"""The Celery app: configured from Django settings (CELERY_ namespace), tasks autodiscovered."""

import os

from celery import Celery

# Without the variable, production: it refuses to start without real secrets, where a
# development default would run with DEBUG and public keys.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

# Celery's Django fixup closes every database connection before and after *each task* unless
# CELERY_DB_REUSE_MAX is set (celery/fixups/django.py: close_database), so each release would
# open a new PostgreSQL connection (~10 ms here, more than the release itself). A connection is
# reused for this many tasks instead: enough that opening one is a rounding error per release;
# Django's CONN_MAX_AGE and health checks still retire an old or broken one, and a broken one
# surfaces as a transient error and is retried.
DB_REUSE_MAX = 1000

# Every task publish is checked against the project's own task queues before Celery routes it
# (cleanup.broker.routes): a caller, Flower or a periodic task may not name another key.
app = Celery("reservations", amqp="cleanup.broker.routes:ScreenedAMQP")
# The app of every thread of this process: cleanup's modules reach it as ``celery.current_app``
# (they never import config), and a thread other than this one (runserver's request threads,
# gunicorn's) would otherwise get Celery's unconfigured fallback app.
app.set_default()
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf["CELERY_DB_REUSE_MAX"] = DB_REUSE_MAX
app.autodiscover_tasks()
# The operator's "pause releases" switch, followed by every worker (cleanup/worker/pause_step.py).
app.steps["consumer"].add("cleanup.worker.pause_step:ReleasePause")
