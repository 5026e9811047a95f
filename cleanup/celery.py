"""``celery -A cleanup worker`` and ``celery -A cleanup beat``: Celery finds the app here."""

from cleanup.broker.celery_app import app

__all__ = ("app",)
