"""One function per `mint` command: `cmd_<name>(ctx) -> exit code`."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from mint_client import errors
from mint_client.cli.context import (
    EXIT_OK,
    Context,
    alias_table,
    revision_table,
    show_alias,
    show_revision,
)
from mint_client.models import Adapter, Alias, Revision, revision_number


def _four_eyes_message(adapter: str, label: str, with_deploy_key: bool) -> str:
    if with_deploy_key:
        return (
            f"Four-eyes: the --deploy-key given belongs to whoever registered {adapter} {label} (or was created by "
            "them); nobody approves their own revision. Pass the deploy key of a second person (an approver or "
            f"owner), or have them run `mint approve {adapter} {label}`."
        )
    return (
        f"Four-eyes: {adapter} {label} was registered with this key, and nobody approves their own revision. "
        f"Pass --deploy-key with a deploy key of a second person (an approver or owner), or have them run "
        f"`mint approve {adapter} {label}`."
    )


def _metrics(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        metrics = json.loads(text)
    except ValueError:
        metrics = None
    if not isinstance(metrics, dict):
        raise errors.ValidationError(f"--metrics must be a JSON object, e.g. '{{\"reward\": 0.4}}', not {text!r}.")
    return metrics


def cmd_push(ctx: Context) -> int:
    a = ctx.args
    a.approve = a.approve or a.activate  # only an approved revision can be activated
    client = ctx.client()
    update, bar = ctx.progress_bar(f"uploading {a.path}")
    with bar:
        revision = client.register(
            a.adapter,
            a.path,
            training_step=a.step,
            parent=a.parent,
            allow_duplicate=a.allow_duplicate,
            progress=update,
            run=a.run,
            metrics=_metrics(a.metrics),
            prewarm=a.ready_to_sample,
        )
    ctx.say(f"registered {a.adapter} {revision.label}")
    result: dict[str, Any] = {"revision": revision.raw}
    if a.ready_to_sample:
        client.wait_until_sampleable(a.adapter, revision.number, timeout=a.timeout)
        revision = client.revision(a.adapter, revision.number)
        result["revision"] = revision.raw
        ctx.say(f"{a.adapter} {revision.label} answers samples ({a.adapter}@{revision.label})")
    if a.wait or a.approve or a.activate:
        revision = client.wait_for(
            a.adapter, revision.number, "exported", timeout=a.timeout, show_progress=not ctx.json
        )
        result["revision"] = revision.raw
        ctx.say(f"{a.adapter} {revision.label} is {revision.state}")
    approver = ctx.client(a.deploy_key) if a.deploy_key else client
    if a.approve:
        if revision.state == "exported":
            revision = client.request_approval(a.adapter, revision.number)
        try:
            revision = approver.approve(
                a.adapter, revision.number, comment=a.comment, override_reason=a.override_reason
            )
        except errors.FourEyesRefused as exc:
            raise errors.FourEyesRefused(
                _four_eyes_message(a.adapter, revision.label, bool(a.deploy_key)),
                code=exc.code,
                status=exc.status,
                detail=exc.detail,
            ) from exc
        except errors.PermissionDenied as exc:
            if a.deploy_key:
                raise
            raise errors.PermissionDenied(
                f"{exc.message} Approving needs a deploy key (scope deploy) of an approver or owner who did not "
                f"register {a.adapter} {revision.label}: pass it with --deploy-key.",
                code=exc.code,
                status=exc.status,
                detail=exc.detail,
            ) from exc
        result["revision"] = revision.raw
        ctx.say(f"{a.adapter} {revision.label} is {revision.state}")
    if a.activate:
        alias = approver.activate(a.adapter, revision.number, alias=a.alias, canary_percent=a.canary)
        if a.wait:
            alias = approver.wait_for_alias(
                a.adapter,
                revision.number,
                alias=a.alias or "production",
                canary=a.canary is not None,
                timeout=a.timeout,
                show_progress=not ctx.json,
            )
        result["alias"] = alias.raw
        ctx.say(f"{a.adapter}:{alias.name} serves {alias.revision or '-'}, wants {alias.desired_revision or '-'}")

    def render() -> None:
        ctx.console.print(revision_table([Revision.from_json(result["revision"])], title=a.adapter))
        if "alias" in result:
            ctx.console.print(alias_table([Alias.from_json(result["alias"])]))

    ctx.emit(result, render)
    return EXIT_OK


def cmd_status(ctx: Context) -> int:
    adapter = ctx.client().adapter(ctx.args.adapter)

    def render() -> None:
        ctx.console.print(f"[bold]{adapter.name}[/] on {adapter.base_model}  {escape(adapter.description)}")
        ctx.console.print(alias_table(adapter.aliases))
        ctx.console.print(revision_table(adapter.latest_revisions, title="latest revisions"))

    ctx.emit(adapter.raw, render)
    return EXIT_OK


def cmd_adapters(ctx: Context) -> int:
    adapters: list[Adapter] = list(ctx.client().adapters())

    def render() -> None:
        table = Table(title="adapters")
        for column in ("name", "base model", "revisions", "production", "description"):
            table.add_column(column)
        for x in adapters:
            prod = x.alias("production")
            table.add_row(
                x.name,
                x.base_model,
                str(x.revision_counter or 0),
                (prod.revision if prod else "") or "-",
                x.description,
            )
        ctx.console.print(table)

    ctx.emit([x.raw for x in adapters], render)
    return EXIT_OK


def cmd_create_adapter(ctx: Context) -> int:
    a = ctx.args
    adapter = ctx.client().create_adapter(a.name, a.base_model, a.description)
    ctx.emit(adapter.raw, lambda: ctx.console.print(f"created {adapter.name} on {adapter.base_model}"))
    return EXIT_OK


def cmd_revisions(ctx: Context) -> int:
    a = ctx.args
    revisions = list(itertools.islice(ctx.client().revisions(a.adapter, state=a.state), a.limit or None))
    ctx.emit([r.raw for r in revisions], lambda: ctx.console.print(revision_table(revisions, title=a.adapter)))
    return EXIT_OK


def cmd_show(ctx: Context) -> int:
    show_revision(ctx, ctx.client().revision(ctx.args.adapter, ctx.args.revision))
    return EXIT_OK


def cmd_wait(ctx: Context) -> int:
    a = ctx.args
    revision = ctx.client().wait_for(a.adapter, a.revision, a.state, timeout=a.timeout, show_progress=not ctx.json)
    show_revision(ctx, revision)
    return EXIT_OK


def cmd_request_approval(ctx: Context) -> int:
    show_revision(ctx, ctx.client().request_approval(ctx.args.adapter, ctx.args.revision))
    return EXIT_OK


def cmd_approve(ctx: Context) -> int:
    a = ctx.args
    try:
        revision = ctx.client().approve(a.adapter, a.revision, comment=a.comment, override_reason=a.override_reason)
    except errors.FourEyesRefused as exc:
        label = f"r{revision_number(a.revision)}"
        raise errors.FourEyesRefused(
            f"Four-eyes: this key belongs to whoever registered {a.adapter} {label} (or was created by them); "
            f"nobody approves their own revision. Use the deploy key of a second person (an approver or owner).",
            code=exc.code,
            status=exc.status,
            detail=exc.detail,
        ) from exc
    show_revision(ctx, revision)
    return EXIT_OK


def cmd_reject(ctx: Context) -> int:
    show_revision(ctx, ctx.client().reject(ctx.args.adapter, ctx.args.revision, ctx.args.comment))
    return EXIT_OK


def cmd_retry(ctx: Context) -> int:
    show_revision(ctx, ctx.client().retry(ctx.args.adapter, ctx.args.revision))
    return EXIT_OK


def cmd_activate(ctx: Context) -> int:
    a = ctx.args
    client = ctx.client()
    alias = client.activate(a.adapter, a.revision, alias=a.alias, canary_percent=a.canary)
    if a.wait:
        alias = client.wait_for_alias(
            a.adapter,
            a.revision,
            alias=a.alias or "production",
            canary=a.canary is not None,
            timeout=a.timeout,
            show_progress=not ctx.json,
        )
    show_alias(ctx, a.adapter, alias)
    return EXIT_OK


def cmd_rollback(ctx: Context) -> int:
    a = ctx.args
    client = ctx.client()
    alias = client.rollback(a.adapter, a.revision, alias=a.alias)
    if a.wait and alias.desired_revision:
        alias = client.wait_for_alias(
            a.adapter,
            alias.desired_revision,
            alias=a.alias or "production",
            timeout=a.timeout,
            show_progress=not ctx.json,
        )
    show_alias(ctx, a.adapter, alias)
    return EXIT_OK


def cmd_promote(ctx: Context) -> int:
    show_alias(ctx, ctx.args.adapter, ctx.client().promote(ctx.args.adapter, alias=ctx.args.alias))
    return EXIT_OK


def cmd_abort(ctx: Context) -> int:
    a = ctx.args
    show_alias(ctx, a.adapter, ctx.client().abort(a.adapter, alias=a.alias, reason=a.reason))
    return EXIT_OK


def cmd_cancel(ctx: Context) -> int:
    show_alias(ctx, ctx.args.adapter, ctx.client().cancel(ctx.args.adapter, alias=ctx.args.alias))
    return EXIT_OK


def cmd_logs(ctx: Context) -> int:
    a = ctx.args
    client = ctx.client()

    def show(events: list) -> None:
        for e in events:  # oldest first, as a log reads
            if ctx.json:
                print(json.dumps(e.raw, default=str), flush=True)
            else:
                ctx.console.print(
                    f"[dim]{(e.at or '')[:19]}[/] [bold]{escape(e.action)}[/] {escape(e.target)} "
                    f"[dim]by {escape(e.actor or '-')}[/]"
                )

    events = list(
        itertools.islice(client.audit(action=a.action, target=a.target, page_size=min(a.limit, 200)), a.limit)
    )
    show(list(reversed(events)))
    last = max((e.id for e in events), default=0)
    while a.follow:
        time.sleep(a.interval)
        fresh = []
        for e in client.audit(action=a.action, target=a.target, page_size=50):
            if e.id <= last:
                break
            fresh.append(e)
        if fresh:
            last = max(e.id for e in fresh)
            show(list(reversed(fresh)))
    return EXIT_OK


def cmd_whoami(ctx: Context) -> int:
    me = ctx.client().whoami()
    ctx.emit(
        me.raw,
        lambda: ctx.console.print(
            f"{me.principal} in [bold]{me.tenant}[/] (scopes: {', '.join(me.scopes or []) or me.role}); "
            f"may: {', '.join(me.capabilities)}"
        ),
    )
    return EXIT_OK


def cmd_usage(ctx: Context) -> int:
    a = ctx.args
    usage = ctx.client().usage(start=a.start, end=a.end, group_by=a.group_by, adapter=a.adapter)

    def render() -> None:
        table = Table(title=f"usage {usage.start} → {usage.end} ({usage.period} rows)")
        counts = ["requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens", "latency_p50_ms"]
        for column in [*usage.columns, *counts]:
            table.add_column(column)
        for row in usage.rows:
            table.add_row(*["-" if row.get(c) is None else str(row.get(c)) for c in [*usage.columns, *counts]])
        ctx.console.print(table)

    ctx.emit(usage.raw, render)
    return EXIT_OK


def cmd_suite(ctx: Context) -> int:
    suite = ctx.client().upload_evaluation_suite(ctx.args.adapter, ctx.args.file)
    ctx.emit(suite.raw, lambda: ctx.console.print(f"suite v{suite.version}: {suite.case_count} cases"))
    return EXIT_OK


def cmd_evaluation(ctx: Context) -> int:
    ev = ctx.client().evaluation(ctx.args.adapter, ctx.args.revision)

    def render() -> None:
        ctx.console.print(
            f"{ctx.args.adapter} {ev.revision} on suite v{ev.suite}: {ev.state}, score {ev.score} "
            f"({ev.cases_passed}/{ev.cases} passed), baseline {ev.baseline_revision} {ev.baseline_score}"
            + (f"; {escape(ev.reason)}" if ev.reason else "")
        )

    ctx.emit(ev.raw, render)
    return EXIT_OK
