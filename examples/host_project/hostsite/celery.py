"""This project's own Celery app, for its own tasks; the apps' workers and beat run on theirs
(``celery -A cleanup worker``). Its workers also read the domain events the outbox publishes
and hand each to ``shop.on_reservation_event``."""

import os

from celery import Celery

from cleanup.worker.events_consumer import events_consumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostsite.settings")

app = Celery("hostsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.steps["consumer"].add(events_consumer(app, "shop.on_reservation_event"))
