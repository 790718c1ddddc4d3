from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"
    verbose_name = "Webhooks"

    def ready(self) -> None:
        from mint_site.events import on_live_event
        from webhooks import services

        # Lifecycle events of adapters and serving reach here without those apps knowing of webhooks.
        on_live_event(services.webhook_live_event, uid="webhooks.live_event")
