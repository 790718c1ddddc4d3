from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from mint_site.errors import MintError
from tenants import selectors, services
from tenants.access import Actor
from tenants.management.lookups import get_tenant, get_user


class Command(BaseCommand):
    help = "Create, revoke and list a tenant's API keys. The token is printed once, at creation."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a key and print its token (shown only this once).")
        create.add_argument("--tenant", required=True)
        create.add_argument("--scopes", required=True, help="Comma-separated: inference,pipeline,deploy")
        create.add_argument("--name", default="cli")
        create.add_argument("--user", default=None, help="The person the key acts for (four-eyes).")
        create.add_argument("--expires-days", type=int, default=None)
        create.add_argument(
            "--adapters", default="", help="Comma-separated adapter names the key may call (default: all of them)."
        )
        create.add_argument("--max-tokens-per-minute", type=int, default=None, help="The key's own tokens per minute.")
        create.add_argument(
            "--monthly-token-budget", type=int, default=None, help="The key's own tokens per calendar month (UTC)."
        )
        revoke = sub.add_parser("revoke", help="Revoke a key by its prefix.")
        revoke.add_argument("prefix")
        lst = sub.add_parser("list", help="List a tenant's keys.")
        lst.add_argument("--tenant", required=True)

    def handle(self, *args, action: str, **options):
        try:
            if action == "create":
                self._create(**options)
            elif action == "revoke":
                self._revoke(options["prefix"])
            else:
                self._list(options["tenant"])
        except MintError as exc:
            raise CommandError(exc.message) from exc

    def _create(
        self, *, tenant, scopes, name, user, expires_days, adapters, max_tokens_per_minute, monthly_token_budget, **_
    ):
        owner = get_user(user) if user else None
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days else None
        key, token = services.api_key_create(
            tenant=get_tenant(tenant),
            name=name,
            scopes=scopes.split(","),
            created_by=owner,
            by=Actor(user=owner),
            expires_at=expires_at,
            adapters=[a for a in adapters.split(",") if a.strip()],
            max_tokens_per_minute=max_tokens_per_minute,
            monthly_token_budget=monthly_token_budget,
        )
        self.stderr.write(
            f"Created key {key.prefix} ({', '.join(key.scopes)}) for {key.tenant.slug}{_limits(key)}. "
            "Store the token now: it is not shown again."
        )
        self.stdout.write(token)

    def _revoke(self, prefix: str):
        key = selectors.api_key_by_prefix(prefix=prefix.removeprefix("mint_").split("_")[0])
        if key is None:
            raise CommandError(f"No key with prefix {prefix!r}.")
        services.api_key_revoke(key=key, by=Actor.system())
        self.stdout.write(f"Revoked {key.prefix} of {key.tenant.slug}")

    def _list(self, tenant: str):
        for key in selectors.api_key_list(tenant=get_tenant(tenant)).order_by("id"):
            used = key.last_used_at.isoformat() if key.last_used_at else "never"
            limits = _limits(key, sep="\t")
            self.stdout.write(
                f"{key.prefix}\t{key.name}\t{','.join(key.scopes)}\t{key.state}\tlast used {used}{limits}"
            )


def _limits(key, *, sep: str = ", ") -> str:
    """The key's allow-list and token limits, those it has."""
    parts = []
    if key.adapters:
        parts.append(f"adapters {','.join(key.adapters)}")
    if key.max_tokens_per_minute is not None:
        parts.append(f"{key.max_tokens_per_minute} tokens/min")
    if key.monthly_token_budget is not None:
        parts.append(f"{key.monthly_token_budget} tokens/month")
    return "".join(sep + part for part in parts)
