from django.core.management.base import BaseCommand, CommandError

from mint_site.errors import MintError
from tenants import services
from tenants.access import Actor
from tenants.models import Tenant

from ._util import get_or_create_user


class Command(BaseCommand):
    help = "Create and list tenants."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a tenant with an owner (the user is created if missing).")
        create.add_argument("slug")
        create.add_argument("--owner", required=True, help="Username of the first owner.")
        create.add_argument("--name", default="", help="Display name (defaults to the slug).")
        create.add_argument("--password", default=None, help="Password for the owner if the user is created.")
        sub.add_parser("list", help="List tenants.")

    def handle(self, *args, action: str, **options):
        if action == "list":
            for tenant in Tenant.objects.all():
                state = "active" if tenant.is_active else "suspended"
                self.stdout.write(f"{tenant.slug}\t{tenant.name}\t{state}")
            return
        owner, created = get_or_create_user(options["owner"], options["password"])
        try:
            tenant = services.tenant_create(slug=options["slug"], name=options["name"], owner=owner, by=Actor.system())
        except MintError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(
            f"Created tenant {tenant.slug} with owner {owner.get_username()}" + (" (new user)" if created else "")
        )
