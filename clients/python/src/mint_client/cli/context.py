"""Exit codes, the context a command runs in (clients, --json or rich output), and the tables it prints."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mint_client import errors
from mint_client.client import Client
from mint_client.models import Alias, Revision

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_VALIDATION, EXIT_POLICY, EXIT_NOT_FOUND, EXIT_AUTH, EXIT_NETWORK = 3, 4, 5, 6, 7


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an error (the table in clients/python/README.md)."""
    if isinstance(exc, (errors.RevisionFailed, errors.ValidationError)):
        return EXIT_VALIDATION
    if isinstance(exc, errors.ConfigurationError | ValueError):
        return EXIT_USAGE
    if isinstance(exc, errors.AuthError):
        return EXIT_AUTH
    if isinstance(exc, errors.NotFound):
        return EXIT_NOT_FOUND
    if isinstance(
        exc, (errors.ConnectionFailed, errors.WaitTimeout, errors.Unavailable, errors.RateLimited, errors.ServerError)
    ):
        return EXIT_NETWORK
    if isinstance(
        exc,
        (
            errors.PermissionDenied,
            errors.Conflict,
            errors.QuotaExceeded,
            errors.RevisionRejected,
            errors.ActivationFailed,
        ),
    ):
        return EXIT_POLICY
    return EXIT_ERROR


class Context:
    """What a command needs: the parsed arguments, its client(s), and where it prints."""

    def __init__(self, args: argparse.Namespace, make_client: Callable[..., Client]) -> None:
        self.args = args
        self.json = bool(getattr(args, "json", False))
        self.console = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)
        self._make_client = lambda api_key: make_client(
            base_url=args.base_url, api_key=api_key, timeout=args.http_timeout, retries=args.retries
        )
        self._client: Client | None = None
        self._others: list[Client] = []
        self._owned: list[Any] = []

    def close(self) -> None:
        for client in [self._client, *self._others, *self._owned]:
            if client is not None:
                client.close()

    def own(self, closable: Any) -> None:
        """Close `closable` (a `Session`, …) when the command ends."""
        self._owned.append(closable)

    def client(self, api_key: str | None = None) -> Client:
        if api_key is not None:
            extra = self._make_client(api_key=api_key)
            self._others.append(extra)
            return extra
        if self._client is None:
            self._client = self._make_client(api_key=self.args.api_key)
        return self._client

    def emit(self, data: Any, render: Callable[[], None] | None = None) -> None:
        """The command's result: JSON on stdout with --json (or without a renderer), else `render()`."""
        if self.json:
            print(json.dumps(data, default=str))
        elif render is None:
            self.console.print_json(json.dumps(data, default=str))
        else:
            render()

    def say(self, text: str) -> None:
        """A line for people (stderr, so stdout stays the result); nothing in --json mode."""
        if not self.json:
            self.err.print(text, soft_wrap=True, markup=False)

    def progress_bar(self, description: str):
        """(callback, context manager) of an upload progress bar, or (None, a no-op) in --json mode."""
        if self.json:
            return None, _Null()
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=self.err,
            transient=True,
        )
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return update, bar


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------- rendering


def revision_table(revisions: list[Revision], title: str | None = None) -> Table:
    table = Table(title=title)
    for column in ("rev", "state", "step", "parent", "rank", "registered by", "created", "failure"):
        table.add_column(column)
    for r in revisions:
        failure = escape(f"{r.failure_code}: {r.failure_reason}") if r.failure else ""
        state = (
            f"[red]{r.state}[/]"
            if r.state == "failed"
            else f"[green]{r.state}[/]"
            if r.state == "approved"
            else r.state
        )
        table.add_row(
            r.label,
            state + (" (stalled)" if r.stalled else ""),
            "" if r.training_step is None else str(r.training_step),
            r.parent or "",
            "" if r.rank is None else str(r.rank),
            r.registered_by or "",
            (r.created_at or "")[:19],
            failure,
        )
    return table


def alias_table(aliases: list[Alias]) -> Table:
    table = Table(title="aliases")
    for column in ("alias", "serves", "desired", "pending", "canary"):
        table.add_column(column)
    for a in aliases:
        pending = escape(f"{a.phase}: {a.reason}") if a.pending else ""
        canary = ""
        if a.canary:
            canary = f"{a.canary.get('revision')} {a.canary.get('percent')}%" + (
                " routing" if a.canary.get("routing") else " (not ready)"
            )
        desired = a.desired_revision if a.desired_revision != a.revision else ""
        table.add_row(a.name, a.revision or "-", desired or "", pending, canary)
    return table


def show_revision(ctx: Context, r: Revision) -> None:
    def render() -> None:
        ctx.console.print(revision_table([r], title=f"{r.adapter} {r.label}"))
        if r.failure:
            ctx.console.print(f"[red]failed[/] {escape(r.failure_code)}: {escape(r.failure_reason)}")

    ctx.emit(r.raw, render)


def show_alias(ctx: Context, adapter: str, alias: Alias) -> None:
    def render() -> None:
        ctx.console.print(alias_table([alias]))

    ctx.emit({"adapter": adapter, **alias.raw}, render)
