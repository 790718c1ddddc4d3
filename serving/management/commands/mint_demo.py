from django.core.management.base import BaseCommand

from tenants import services
from tenants.access import Actor
from tenants.management.lookups import get_or_create_user
from tenants.models import ApiKey, Scope, Tenant

DEMO_KEY_NAME = "demo"


class Command(BaseCommand):
    help = "Seed the demo tenant and its owner login, and print a fresh demo API key (the previous one is revoked)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--owner", default="demo")
        parser.add_argument("--password", default="mint-demo-password")

    def handle(self, *args, tenant: str, owner: str, password: str, **options):
        user, created = get_or_create_user(owner, password)
        if not created and not user.has_usable_password():
            user.set_password(password)
            user.save(update_fields=["password"])
        demo = Tenant.objects.filter(slug=tenant).first()
        if demo is None:
            demo = services.tenant_create(slug=tenant, name="Demo", owner=user, by=Actor.system())
            # One person walks the whole loop in the demo; real tenants keep four-eyes on.
            Tenant.objects.filter(id=demo.id).update(four_eyes=False)
        for old in ApiKey.objects.filter(tenant=demo, name=DEMO_KEY_NAME, revoked_at__isnull=True):
            services.api_key_revoke(key=old, by=Actor.system())
        _, token = services.api_key_create(
            tenant=demo, name=DEMO_KEY_NAME, scopes=Scope.values, created_by=user, by=Actor.system()
        )
        self.stdout.write(token)
