"""The benchmark's settings: the test settings plus both candidate libraries, and a URLconf
that mounts the same operations three ways."""

from config.settings.test import *  # noqa: F403
from config.settings.test import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "rest_framework", "drf_spectacular", "ninja"]
ROOT_URLCONF = "bench.api_latency.urls"
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
DEBUG = False
ALLOWED_HOSTS = ["testserver"]  # django.test.Client
