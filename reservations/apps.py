from django.apps import AppConfig


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
