from django.apps import AppConfig


class CleanupConfig(AppConfig):
    name = "cleanup"
    verbose_name = "Cleanup"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (connects the Celery signal handlers)
