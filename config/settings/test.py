"""Test settings: short leases and timeouts so real-worker scenarios finish in seconds.

Tests use their own database (pytest-django prefixes ``test_``) and their own Redis database
number; they never flush or reconfigure a shared server.
"""

import os

from config.settings import tuning

TEST_DEFAULTS = {
    "SECRET_KEY": "test-only-not-secret",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/reservations",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/13",
    "RESERVATIONS_API_TOKEN": "test-token",
    "CLEANUP_TASK_TIME_LIMIT": "10",
    "CLEANUP_TASK_SOFT_TIME_LIMIT": "8",
    "CLEANUP_RETRY_BACKOFF_MAX": "2",
    "CLEANUP_VISIBILITY_TIMEOUT": "15",
    "CLEANUP_LEASE_SECONDS": "5",
}
for _name, _value in TEST_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
# Tuning settings (never read from the environment) shortened the same way; a test's child
# process may choose its own first (config.settings.tuning, tests/support/child_settings.py).
TEST_TUNING = {
    "CLEANUP_UNACKED_RESTORE_INTERVAL": 1,
    "CLEANUP_BEAT_IDLE_SESSION_TIMEOUT": 5,
}
for _name, _tuned in TEST_TUNING.items():
    tuning.VALUES.setdefault(_name, _tuned)

from .base import *  # noqa: E402,F403

CELERY_BEAT_MAX_LOOP_INTERVAL = 1

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
