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
    """A warning when no Redis counts the API clients' requests: their limits do not apply."""
    from django.core import checks  # noqa: PLC0415

    from .ratelimit import redis_url  # noqa: PLC0415 - needs the settings

    if redis_url():
        return []
    return [
        checks.Warning(
            "API rate limits are not enforced: no Redis to count requests in",
            hint=(
                "set RESERVATIONS_API_RATE_LIMIT_REDIS_URL (or CLEANUP_COUNTER_REDIS_URL) to a "
                "redis:// or rediss:// URL"
            ),
            id="reservations.W001",
        )
    ]
