"""The Celery app: configured from Django settings (CELERY_ namespace), tasks autodiscovered."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

app = Celery("reservations")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
