"""What the tests share: the worker fleet and SQL helpers (``fleet``), the web behind gunicorn
(``web``), the production-stack drill's machinery (``prodstack``), hand-written wire messages
(``wire``), a fresh interpreter (``child_python``), the quick start's ``.env`` (``quick_start``),
missing-tool skips (``missing_tools``), the poison task test workers load (``poison_tasks``),
and the set-ups many tests repeat: expired holds (``holds``), staff clients (``staff``) and the
API's token (``api``), whose fixtures ``fixtures`` registers for every test.

Nothing here is a test: unit and integration tests import from here, never from each other.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (manage.py, pyproject.toml)
