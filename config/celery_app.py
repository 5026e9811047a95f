"""The Celery app: configured from Django settings (CELERY_ namespace), tasks autodiscovered."""

import os

from celery import Celery  # (celery does not import prometheus_client)

# Before any project module: sets PROMETHEUS_MULTIPROC_DIR for a worker (FIELD-NOTES §3).
import cleanup.worker_boot  # noqa: F401

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

app = Celery("reservations")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
