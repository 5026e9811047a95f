"""The benchmark's settings: the test settings plus the candidate libraries installed, and a
URLconf that mounts the same operations each way."""

from importlib.util import find_spec

from config.settings.test import *  # noqa: F403
from config.settings.test import INSTALLED_APPS

# Django REST framework is not in requirements-dev.txt: its variant runs when installed by hand.
HAS_DRF = find_spec("rest_framework") is not None and find_spec("drf_spectacular") is not None
INSTALLED_APPS = [*INSTALLED_APPS, *(["ninja"] if "ninja" not in INSTALLED_APPS else [])]
if HAS_DRF:
    INSTALLED_APPS += ["rest_framework", "drf_spectacular"]
    REST_FRAMEWORK = {
        "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
        "UNAUTHENTICATED_USER": None,
    }
ROOT_URLCONF = "bench.api_latency.urls"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]  # django.test.Client
