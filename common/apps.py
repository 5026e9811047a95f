from django.apps import AppConfig


class CommonConfig(AppConfig):
    name = "common"
    verbose_name = "Common plumbing"

    def ready(self) -> None:
        from . import db  # noqa: PLC0415 - the connection hook registers once the app registry is ready

        db.install()
