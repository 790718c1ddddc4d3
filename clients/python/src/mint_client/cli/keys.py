"""`mint login`, `mint logout` and `mint keys …`: a person's session, and the key management only it may do.

A key never manages keys, so these commands never use one (`--api-key` is ignored here): `mint login` signs in
with a password and keeps the session cookie and CSRF token in `SessionStore` (0600), per base URL.
"""

from __future__ import annotations

import getpass
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

from rich.markup import escape
from rich.table import Table

from mint_client import errors
from mint_client.cli.context import EXIT_OK, Context
from mint_client.models import ApiKey
from mint_client.session import Session, SessionStore, normal_base_url

PASSWORD_MAX_CHARS = 1024  # the server's bound (tenants/session_apis.py)
_DURATION = re.compile(r"^(\d+)([dhm])$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def _username(ctx: Context) -> str:
    a = ctx.args
    if a.username:
        return a.username
    if a.password_stdin or not sys.stdin.isatty():
        raise ValueError("Name the person with --username (stdin is not a terminal to ask on).")
    sys.stderr.write("Username: ")
    sys.stderr.flush()
    name = sys.stdin.readline().strip()
    if not name:
        raise ValueError("No username given.")
    return name


def _password(ctx: Context, username: str, base_url: str) -> str:
    if ctx.args.password_stdin:
        password = sys.stdin.readline(PASSWORD_MAX_CHARS + 2).rstrip("\r\n")
    else:
        password = getpass.getpass(f"Password for {username} at {base_url}: ")
    if not password:
        raise ValueError("No password given (--password-stdin reads it from the first line of stdin).")
    return password


def parse_expires(text: str, *, now: datetime | None = None) -> datetime:
    """`--expires`: a duration from now (30d, 12h, 90m) or an ISO date or date-time (UTC unless it says)."""
    now = now or datetime.now(timezone.utc)
    if match := _DURATION.match(text.strip()):
        return now + timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--expires takes a duration (30d, 12h, 90m) or an ISO date or date-time (2027-01-31, "
            f"2027-01-31T12:00:00Z), not {text!r}."
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _names(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def session_of(ctx: Context) -> Session:
    a = ctx.args
    session = Session.from_store(a.base_url, tenant=a.tenant, timeout=a.http_timeout, retries=a.retries)
    ctx.own(session)
    return session


@contextmanager
def tenant_named(session: Session) -> Iterator[None]:
    """The server's 400 for a person in several tenants, none named, as the CLI's usage error: pass --tenant."""
    try:
        yield
    except errors.ValidationError as exc:
        if not (isinstance(exc.detail, dict) and "X-Mint-Tenant" in exc.detail):
            raise
        slugs = ", ".join(str(t.get("slug")) for t in session.stored.tenants) or "see `mint login --json`"
        raise errors.ConfigurationError(
            f"You belong to several tenants ({slugs}) and none was chosen at `mint login`: pass --tenant <slug>.",
            code="tenant_ambiguous",
            status=exc.status,
        ) from exc


def cmd_login(ctx: Context) -> int:
    a = ctx.args
    base_url = normal_base_url(a.base_url)
    username = _username(ctx)
    password = _password(ctx, username, base_url)
    session = Session.login(base_url, username, password, tenant=a.tenant, timeout=a.http_timeout)
    ctx.own(session)
    path = session.save(SessionStore())
    stored = session.stored
    result = {
        "base_url": base_url,
        "user": stored.user,
        "tenant": stored.tenant,
        "tenants": stored.tenants,
        "session_file": str(path),
    }

    def render() -> None:
        roles = {t.get("slug"): t.get("role") for t in stored.tenants}
        where = f"tenant {stored.tenant} ({roles.get(stored.tenant)})" if stored.tenant else "no tenant chosen"
        ctx.console.print(f"Signed in to {escape(base_url)} as [bold]{escape(stored.user)}[/], {escape(where)}.")
        if stored.tenant is None and len(stored.tenants) > 1:
            slugs = ", ".join(str(t.get("slug")) for t in stored.tenants)
            ctx.console.print(
                f"You belong to several tenants ({escape(slugs)}): pass --tenant to `mint keys`, or sign in "
                "again with `mint login --tenant <slug>`."
            )
        ctx.console.print(f"[dim]Session kept in {escape(str(path))} (readable by you only).[/]")

    ctx.emit(result, render)
    return EXIT_OK


def cmd_logout(ctx: Context) -> int:
    a = ctx.args
    base_url = normal_base_url(a.base_url)
    store = SessionStore()
    try:
        session = Session.from_store(base_url, store=store, timeout=a.http_timeout, retries=a.retries)
    except errors.NotSignedIn:
        ctx.emit({"base_url": base_url, "signed_out": False}, lambda: ctx.say(f"Not signed in to {base_url}."))
        return EXIT_OK
    ctx.own(session)
    session.logout(store)
    ctx.emit(
        {"base_url": base_url, "user": session.user, "signed_out": True},
        lambda: ctx.say(f"Signed {session.user} out of {base_url}; the session is forgotten here too."),
    )
    return EXIT_OK


def _keys_table(keys: list[ApiKey]) -> Table:
    table = Table(title="API keys")
    for column in ("name", "key", "scopes", "state", "created by", "created", "last used", "expires", "adapters"):
        table.add_column(column)
    for k in keys:
        table.add_row(
            escape(k.name),
            f"mint_{k.prefix}_…",
            ",".join(k.scopes),
            k.state,
            escape(k.created_by or "-"),
            (k.created_at or "")[:19],
            (k.last_used_at or "-")[:19],
            (k.expires_at or "-")[:19],
            escape(",".join(k.adapters)) or "all",
        )
    return table


def cmd_keys_list(ctx: Context) -> int:
    session = session_of(ctx)
    with tenant_named(session):
        keys = list(session.api_keys())
    ctx.emit([k.raw for k in keys], lambda: ctx.console.print(_keys_table(keys)))
    return EXIT_OK


def cmd_keys_create(ctx: Context) -> int:
    a = ctx.args
    scopes = _names(a.scopes)
    if not scopes:
        raise ValueError("--scopes names at least one of inference, pipeline, deploy (comma-separated).")
    expires_at = parse_expires(a.expires) if a.expires else None
    session = session_of(ctx)
    with tenant_named(session):
        key = session.create_key(
            a.name,
            scopes,
            expires_at=expires_at,
            adapters=_names(a.adapters),
            max_tokens_per_minute=a.max_tokens_per_minute,
            monthly_token_budget=a.monthly_token_budget,
        )

    def render() -> None:
        ctx.say(
            f"Created key {key.name} (mint_{key.prefix}_…) with scopes {','.join(key.scopes)}"
            + (f", expiring {key.expires_at}" if key.expires_at else "")
            + ". Its token follows, shown this once: keep it now, MinT cannot show it again."
        )
        print(key.token)  # plain, alone on stdout: TOKEN=$(mint keys create …)

    ctx.emit(key.raw, render)
    return EXIT_OK


def cmd_keys_revoke(ctx: Context) -> int:
    prefix = ctx.args.prefix.removeprefix("mint_").split("_", 1)[0]
    session = session_of(ctx)
    with tenant_named(session):
        session.revoke_key(prefix)
    ctx.emit({"revoked": prefix}, lambda: ctx.say(f"Revoked mint_{prefix}_…; requests with it are refused from now."))
    return EXIT_OK
