from django.core.management.base import BaseCommand, CommandError

from mint_site.errors import MintError
from tenants import selectors, services
from tenants.access import Actor
from tenants.management.lookups import get_or_create_user, get_tenant, get_user
from tenants.models import Role


class Command(BaseCommand):
    help = "Add, change, remove and list the members of a tenant."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="Add a member, or change their role (the user is created if missing).")
        add.add_argument("--tenant", required=True)
        add.add_argument("--user", required=True)
        add.add_argument("--role", required=True, choices=Role.values)
        add.add_argument("--password", default=None, help="Password if the user is created.")
        remove = sub.add_parser("remove", help="Remove a member.")
        remove.add_argument("--tenant", required=True)
        remove.add_argument("--user", required=True)
        lst = sub.add_parser("list", help="List members.")
        lst.add_argument("--tenant", required=True)

    def handle(self, *args, action: str, **options):
        tenant = get_tenant(options["tenant"])
        try:
            if action == "add":
                user, _ = get_or_create_user(options["user"], options["password"])
                services.membership_set(tenant=tenant, user=user, role=options["role"], by=Actor.system())
                self.stdout.write(f"{user.get_username()} is {options['role']} in {tenant.slug}")
            elif action == "remove":
                services.membership_remove(tenant=tenant, user=get_user(options["user"]), by=Actor.system())
                self.stdout.write(f"Removed {options['user']} from {tenant.slug}")
            else:
                for membership in selectors.membership_list(tenant=tenant):
                    self.stdout.write(f"{membership.user.get_username()}\t{membership.role}")
        except MintError as exc:
            raise CommandError(exc.message) from exc
