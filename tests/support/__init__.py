"""What the tests share; nothing here is a test. Unit and integration tests import from here,
never from each other (or from a conftest.py).

- processes: the worker fleet and its SQL helpers (``fleet``), the web behind gunicorn
  (``web``), the production-stack drill's machinery (``prodstack``), the poison task test
  workers load (``poison_tasks``), a fresh interpreter (``child_python``), a private Redis
  Sentinel (``sentinel``);
- data as the tests make it: expired holds (``holds``), dead letters (``dead_letters``), broker
  entries planted in Redis (``planted``), release messages written by hand (``wire``), the
  quick start's ``.env`` (``quick_start``);
- clients and readers: logged-in admin clients (``staff``), the JSON API with a token
  (``api``), management commands (``commands``), the beat schedule (``schedule``), metrics
  (``metrics``);
- missing-tool skips (``missing_tools``).

The fixtures of ``api``, ``staff`` and ``web`` are registered for every test
(tests/conftest.py's ``pytest_plugins``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (manage.py, pyproject.toml)
