"""Production: no secret has a default; a missing one fails at start-up naming the variable."""

from config.env import env_bool, env_str

from .base import *  # noqa: F403

DEBUG = env_bool("DEBUG", False)
FLOWER_BASIC_AUTH = env_str("FLOWER_BASIC_AUTH")
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", True)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", True)
