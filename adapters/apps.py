from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "adapters"
    verbose_name = "Base models, adapters and revisions"
