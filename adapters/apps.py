from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "adapters"
    verbose_name = "Base models, adapters and revisions"

    def ready(self) -> None:
        # Registered with Celery in every process, not only in workers: the control queue sends them by name
        # (adapters/dispatch.py) from wherever a revision joins or leaves it.
        from adapters import tasks  # noqa: F401
