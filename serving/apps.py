from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving nodes, placements and the gateway"

    def ready(self) -> None:
        from mint_site.metrics import register_shared_collector
        from serving.metrics import ServingCollector

        # Read from the database at scrape time: served once per scrape, however many web processes serve.
        register_shared_collector(ServingCollector())
