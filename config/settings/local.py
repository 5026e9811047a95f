"""Local development: safe defaults so `make run` works on a fresh clone."""

import os

os.environ.setdefault("SECRET_KEY", "local-dev-only-not-secret")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/reservations")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
os.environ.setdefault("RESERVATIONS_API_TOKEN", "local-dev-token")
os.environ.setdefault("DEBUG", "true")

from .base import *  # noqa: F403
