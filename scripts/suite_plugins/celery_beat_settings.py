"""Django settings for django-celery-beat's own scheduler tests run against our
``LeaderDatabaseScheduler``: the suite's own test project (``t.proj.settings`` of its sdist),
with only what importing and running our scheduler needs added.

- ``cleanup`` is installed for its models alone (``cleanup.release.schedule`` imports one at
  the top), without its ``ready()``: no product signal handler joins the suite's Celery app.
- The admin is installed without autodiscovery, so ``cleanup.admin`` (which needs the whole
  product) is not imported; the suite's tests import django-celery-beat's admin themselves.
- The suite keeps its SQLite database: its tests call the scheduler inside pytest-django's test
  transaction, and the scheduler's ``close_old_connections()`` closes a PostgreSQL connection
  there (every database test then fails with "the connection is closed", with or without our
  scheduler); SQLite's in-memory test database survives it. The scheduler's lease is a
  PostgreSQL session of its own, built by ``_lock_conninfo`` from ``DATABASES["default"]``'s
  user, password, host, port and options: those name ``DATABASE_URL``'s server here (Django's
  SQLite backend ignores them; the suite's SQLite ``timeout`` option is dropped, it only matters
  for a database file). The database name is the one thing Django rewrites during the tests (to
  the in-memory test database's), so ``suite_plugins.celery_beat`` points the lease at the
  server's ``postgres`` database, which always exists.
- The lease uses a lock id of its own, so a beat of the product on the same database is never
  in the way (nor taken from).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from t.proj.settings import *  # noqa: F403 - the suite's own project, extended below
from t.proj.settings import INSTALLED_APPS

ROOT = Path(__file__).resolve().parents[2]


def _database_url() -> dict[str, Any]:
    # config/env.py by path: importing the config package would create and set as default the
    # product's Celery app in the suite's process.
    spec = importlib.util.spec_from_file_location("reservations_env", ROOT / "config" / "env.py")
    assert spec is not None and spec.loader is not None
    env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env)
    parsed: dict[str, Any] = env.parse_database_url("DATABASE_URL", env.env_str("DATABASE_URL"))
    return parsed


_lease = _database_url()

INSTALLED_APPS = [
    "django.contrib.admin.apps.SimpleAdminConfig" if app == "django.contrib.admin" else app
    for app in INSTALLED_APPS
] + ["suite_plugins.celery_beat.CleanupModelsOnly"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
        "USER": _lease["USER"],
        "PASSWORD": _lease["PASSWORD"],
        "HOST": _lease["HOST"],
        "PORT": _lease["PORT"],
    }
}

CLEANUP_BEAT_LOCK_ID = 727_999
CLEANUP_BEAT_IDLE_SESSION_TIMEOUT = 30
# The lease's connection is the session alias's (reservations.db.session_alias): without a
# transaction pooler, Django's default one, whose server the entry above names.
DATABASE_SESSION_ALIAS = "default"
