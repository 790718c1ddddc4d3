from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving nodes, placements and the gateway"

    def ready(self) -> None:
        from mint_site.metrics import register_shared_collector
        from serving.metrics import ServingCollector

        # Read from the database at scrape time: served once per scrape, however many web processes serve.
        register_shared_collector(ServingCollector())

        from adapters.signals import evaluation_requested
        from serving.services.evaluation import evaluation_requested as run_evaluation

        # The evaluation runner reacts to the catalog's requests (adapters never imports serving).
        evaluation_requested.connect(run_evaluation, dispatch_uid="serving.evaluation_runner")
