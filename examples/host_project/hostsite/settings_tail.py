# --- reservation-cleanup -------------------------------------------------------------------
# What a project adds to its settings to run the apps (docs/INTEGRATION.md): the apps, a
# PostgreSQL database and a broker. Every other setting of the apps has a default.
import os

INSTALLED_APPS += [  # noqa: F821 - the generated settings define it
    "django_celery_beat",  # the schedule beat reads, editable in the admin
    "reservations",
    "cleanup",
    "shop",  # this project's own app: orders that hold a seat
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SHOP_DATABASE_NAME", "shop"),
        "HOST": os.environ.get("SHOP_DATABASE_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SHOP_DATABASE_PORT", "5432"),
        "USER": os.environ.get("SHOP_DATABASE_USER", "postgres"),
    }
}
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
