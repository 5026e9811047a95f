"""The example project's Celery app: the apps' own (``cleanup.celery``), made this process's
default, configured from Django settings (CELERY_ namespace) under the apps' delivery policy."""

import os

# Without the variable, production: it refuses to start without real secrets, where a
# development default would run with DEBUG and public keys.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

from cleanup.celery import app

# The app of every thread of this process: a thread other than this one (runserver's request
# threads, gunicorn's) would otherwise get Celery's unconfigured fallback app.
app.set_default()

__all__ = ("app",)
