from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving nodes, placements and the gateway"

    def ready(self) -> None:
        from prometheus_client import REGISTRY

        from serving.metrics import ServingCollector

        REGISTRY.register(ServingCollector())
