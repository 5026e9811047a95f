from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage


class ReservationsConfig(AppConfig):
    name = "reservations"
    verbose_name = "Reservations"

    def ready(self) -> None:
        from django.core import checks  # noqa: PLC0415

        from . import db, pooling  # noqa: PLC0415 - the connection hook registers once the app registry is ready

        db.install()
        # `manage.py check --database default` and `migrate` refuse an undeclared transaction
        # pooler (and a pooled DATABASE_DIRECT_URL), as the worker and beat do at start.
        checks.register(pooling.check, checks.Tags.database)
        checks.register(_rate_limits_enforced)


def _rate_limits_enforced(app_configs: Any = None, **_: Any) -> list[CheckMessage]:
    """A warning when no Redis counts the API clients' requests: their limits do not apply. An
    error when that Redis is a ``sentinel://`` URL the limiter cannot follow (no master name,
    or a form the project does not support): the limiter would fail open on every request."""
    from django.conf import settings  # noqa: PLC0415
    from django.core import checks  # noqa: PLC0415
    from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

    from . import redis_sentinel  # noqa: PLC0415
    from .ratelimit import redis_url  # noqa: PLC0415 - needs the settings

    url = redis_url()
    if redis_sentinel.is_sentinel(url):
        master = str(getattr(settings, redis_sentinel.MASTER_VARIABLE, ""))
        try:
            redis_sentinel.parse("the API rate limiter's Redis", url, master)
        except ImproperlyConfigured as refused:
            return [checks.Error(str(refused), id="reservations.E002")]
    if url:
        return []
    return [
        checks.Warning(
            "API rate limits are not enforced: no Redis to count requests in",
            hint=(
                "set RESERVATIONS_API_RATE_LIMIT_REDIS_URL (or CLEANUP_COUNTER_REDIS_URL) to a "
                "redis://, rediss:// or sentinel:// URL"
            ),
            id="reservations.W001",
        )
    ]
