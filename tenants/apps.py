from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, members and API keys"

    def ready(self) -> None:
        from tenants import signals

        # Keys follow people: changes made outside the services (the admin) are announced too.
        signals.connect()
