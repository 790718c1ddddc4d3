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

        from adapters.signals import revision_exported, storage_needed
        from serving.services.retention import on_revision_exported, on_storage_needed

        # Retention follows the catalog: after each export, and when a registration finds the quota full.
        revision_exported.connect(on_revision_exported, dispatch_uid="serving.retention_on_export")

        from serving.services.sampling import on_revision_exported as prewarm_on_export

        # A revision registered to be sampled at once (`prewarm`) is placed as soon as it is exported.
        revision_exported.connect(prewarm_on_export, dispatch_uid="serving.prewarm_on_export")
        storage_needed.connect(on_storage_needed, dispatch_uid="serving.retention_make_room")

        # Services send tasks by name (serving/services/outbox.py): registered in every process, a name sent
        # where tasks run at once (MINT_TASKS_EAGER, the tests) runs rather than waiting on the broker.
        import serving.tasks  # noqa: F401
