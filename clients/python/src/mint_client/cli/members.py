"""`mint members list|invite|role|remove`: the tenant's people, for owners, on the session `mint login` keeps
(people are managed by people, never by a key)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from mint_client.cli.context import EXIT_OK, Context
from mint_client.cli.keys import session_of, tenant_named


def cmd_members_list(ctx: Context) -> int:
    session = session_of(ctx)
    with tenant_named(session):
        people = session.members()

    def render() -> None:
        table = Table(title="Members")
        for column in ("username", "email", "role", "joined", "last activity"):
            table.add_column(column)
        for m in people:
            table.add_row(
                escape(m["username"]),
                escape(m.get("email") or "-"),
                m["role"],
                (m.get("joined_at") or "")[:19],
                (m.get("last_activity") or "never")[:19],
            )
        ctx.console.print(table)

    ctx.emit(people, render)
    return EXIT_OK


def cmd_members_invite(ctx: Context) -> int:
    a = ctx.args
    who = a.who.strip()
    session = session_of(ctx)
    with tenant_named(session):
        by = {"email": who} if "@" in who else {"username": who}
        invitation = session.invite(a.role, **by)
    ctx.emit(
        invitation,
        lambda: ctx.say(
            f"Invited {invitation['email']} as {invitation['role']}; the link was mailed to them and works until "
            f"{invitation['expires_at'][:19]}."
        ),
    )
    return EXIT_OK


def cmd_members_role(ctx: Context) -> int:
    a = ctx.args
    session = session_of(ctx)
    with tenant_named(session):
        member = session.set_role(a.username, a.role)
    ctx.emit(member, lambda: ctx.say(f"{member['username']} is now {member['role']}."))
    return EXIT_OK


def cmd_members_remove(ctx: Context) -> int:
    a = ctx.args
    session = session_of(ctx)
    with tenant_named(session):
        session.remove_member(a.username)
    ctx.emit(
        {"removed": a.username},
        lambda: ctx.say(f"Removed {a.username}; the keys they made in the tenant stopped working."),
    )
    return EXIT_OK
