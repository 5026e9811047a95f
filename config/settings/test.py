"""Test settings: short leases and timeouts so real-worker scenarios finish in seconds.

Tests use their own database (pytest-django prefixes ``test_``) and their own Redis database
number; they never flush or reconfigure a shared server.
"""

import os

os.environ.setdefault("SECRET_KEY", "test-only-not-secret")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/reservations")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("RESERVATIONS_API_TOKEN", "test-token")
os.environ.setdefault("CLEANUP_TASK_TIME_LIMIT", "10")
os.environ.setdefault("CLEANUP_TASK_SOFT_TIME_LIMIT", "8")
os.environ.setdefault("CLEANUP_RETRY_BACKOFF_MAX", "2")
os.environ.setdefault("CLEANUP_VISIBILITY_TIMEOUT", "15")
os.environ.setdefault("CLEANUP_UNACKED_RESTORE_INTERVAL", "1")
os.environ.setdefault("CLEANUP_LEASE_SECONDS", "5")
os.environ.setdefault("CELERY_BEAT_MAX_LOOP_INTERVAL", "1")
os.environ.setdefault("CLEANUP_BEAT_IDLE_SESSION_TIMEOUT", "5")

from .base import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
