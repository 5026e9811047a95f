from django.apps import AppConfig


class CleanupConfig(AppConfig):
    name = "cleanup"
    verbose_name = "Cleanup"

    def ready(self) -> None:
        # Connect Celery signal handlers (signals: publish, dead letters; observability: metrics)
        from . import observability, signals  # noqa: F401, PLC0415
