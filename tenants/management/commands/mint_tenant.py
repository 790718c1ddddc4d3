from django.core.management.base import BaseCommand, CommandError

from mint_site.errors import MintError
from tenants import services
from tenants.access import Actor
from tenants.management.lookups import get_or_create_user
from tenants.models import Tenant

# The plan: every per-tenant limit (docs/limits.md, "Plan fields"), and what the tenant uses of the storage ones.
PLAN_FIELDS = tuple(name for name in services.TENANT_UPDATABLE_FIELDS if name not in ("name", "is_active"))
USAGE_FIELDS = ("stored_bytes", "stored_revisions")


class Command(BaseCommand):
    help = "Create and list tenants; show or change a tenant's plan."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a tenant with an owner (the user is created if missing).")
        create.add_argument("slug")
        create.add_argument("--owner", required=True, help="Username of the first owner.")
        create.add_argument("--name", default="", help="Display name (defaults to the slug).")
        create.add_argument("--password", default=None, help="Password for the owner if the user is created.")
        sub.add_parser("list", help="List tenants.")
        plan = sub.add_parser("plan", help="Show a tenant's plan limits and use; change them with --set.")
        plan.add_argument("slug")
        plan.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="FIELD=VALUE",
            help=f"Change one limit (repeatable; audited as tenant.update): {', '.join(PLAN_FIELDS)}.",
        )

    def handle(self, *args, action: str, **options):
        if action == "plan":
            self._plan(options["slug"], options["set"])
            return
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

    def _plan(self, slug: str, assignments: list[str]) -> None:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"No tenant {slug!r}.")
        changes = {}
        for assignment in assignments:
            field, sep, value = assignment.partition("=")
            if not sep or field not in PLAN_FIELDS:
                raise CommandError(f"--set takes FIELD=VALUE with FIELD one of {', '.join(PLAN_FIELDS)}.")
            changes[field] = value
        if changes:
            try:
                tenant = services.tenant_update(tenant=tenant, changes=changes, by=Actor.system())
            except MintError as exc:
                raise CommandError(exc.message) from exc
        for field in PLAN_FIELDS + USAGE_FIELDS:
            self.stdout.write(f"{field}\t{getattr(tenant, field)}")
