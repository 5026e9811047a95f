from django.apps import AppConfig


class CleanupConfig(AppConfig):
    name = "cleanup"
    verbose_name = "Cleanup"

    def ready(self) -> None:
        # Connect Celery signal handlers (signals: publish, dead letters; observability: metrics)
        from cleanup.operations import worker_metrics  # noqa: F401, PLC0415
        from cleanup.worker import signals  # noqa: F401, PLC0415
