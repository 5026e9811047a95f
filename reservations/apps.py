from django.apps import AppConfig


class ReservationsConfig(AppConfig):
    name = "reservations"
    verbose_name = "Reservations"

    def ready(self) -> None:
        from . import db  # noqa: PLC0415 - the connection hook registers once the app registry is ready

        db.install()
