"""`mint` commands for the rest of an adapter's life: deactivate, archive, restore, keep, retention, edit-adapter,
delete-adapter, diff, lineage, download."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from mint_client import errors
from mint_client.cli.context import EXIT_OK, EXIT_USAGE, Context, show_revision


def cmd_deactivate(ctx: Context) -> int:
    a = ctx.args
    done = ctx.client().deactivate(a.adapter, alias=a.alias)
    model = a.adapter if done["alias"] == "production" else f"{a.adapter}:{done['alias']}"
    named = ", ".join(done.get("named") or []) or "nothing"
    ctx.emit(
        done,
        lambda: ctx.console.print(
            f"{a.adapter}:{done['alias']} deactivated: requests for {model} answer 404 now; it named {named}."
        ),
    )
    return EXIT_OK


def cmd_archive(ctx: Context) -> int:
    a = ctx.args
    revision = ctx.client().archive(a.adapter, a.revision, keep_source=a.keep_source, reason=a.reason)
    ctx.say(
        f"{a.adapter} {revision.label} archived"
        + ("; its source is kept, `mint restore` can bring it back" if a.keep_source else "; its files are removed")
    )
    show_revision(ctx, revision)
    return EXIT_OK


def cmd_restore(ctx: Context) -> int:
    a = ctx.args
    revision = ctx.client().restore(a.adapter, a.revision)
    ctx.say(f"{a.adapter} {revision.label} is {revision.state} again; its export is being written from its source")
    show_revision(ctx, revision)
    return EXIT_OK


def cmd_keep(ctx: Context) -> int:
    a = ctx.args
    revision = ctx.client().keep(a.adapter, a.revision, keep=not a.off)
    ctx.say(
        f"{a.adapter} {revision.label} " + ("is no longer kept" if a.off else "is kept: retention never archives it")
    )
    show_revision(ctx, revision)
    return EXIT_OK


def cmd_retention(ctx: Context) -> int:
    a = ctx.args
    client = ctx.client()
    if a.plan:
        preview = client.set_retention(a.adapter, None, None)
    elif a.keep_last is not None or a.grace_days is not None:
        current = client.retention(a.adapter)["policy"]
        keep_last = a.keep_last if a.keep_last is not None else current["keep_last"] or None
        preview = client.set_retention(a.adapter, keep_last, a.grace_days)
    else:
        preview = client.retention(a.adapter)

    def render() -> None:
        policy = preview["policy"]
        if not policy["keep_last"]:
            ctx.console.print(f"{a.adapter}: no retention (the plan keeps every revision)")
            return
        whose = "its own" if policy["source"] == "adapter" else "the tenant plan's"
        ctx.console.print(
            f"{a.adapter} ({whose}): keep the newest {policy['keep_last']}, the named within "
            f"{policy['grace_days']} days, the kept and the pending"
        )
        would = preview["would_archive"]
        ctx.console.print(f"dry run: archives {len(would)}: {', '.join(would[:30]) or 'nothing'}")

    ctx.emit(preview, render)
    return EXIT_OK


def cmd_edit_adapter(ctx: Context) -> int:
    a = ctx.args
    if a.description is None and a.tag is None:
        ctx.err.print("nothing to change: pass --description and/or --tag")
        return EXIT_USAGE
    adapter = ctx.client().update_adapter(a.adapter, description=a.description, tags=a.tag)
    ctx.emit(adapter.raw, lambda: ctx.console.print(f"{adapter.name}: {escape(adapter.description)}"))
    return EXIT_OK


def cmd_delete_adapter(ctx: Context) -> int:
    a = ctx.args
    if a.yes != a.adapter:
        ctx.err.print(f"deleting archives every revision of {a.adapter}: confirm with --yes {a.adapter}")
        return EXIT_USAGE
    done = ctx.client().delete_adapter(a.adapter)
    ctx.emit(
        done, lambda: ctx.console.print(f"{a.adapter} deleted; archived {', '.join(done['archived']) or 'nothing'}")
    )
    return EXIT_OK


def cmd_diff(ctx: Context) -> int:
    a = ctx.args
    diff = ctx.client().diff(a.adapter, a.a, a.b)

    def render() -> None:
        config = Table(title=f"{a.adapter} {diff['a']} and {diff['b']}")
        for column in ("field", diff["a"], diff["b"]):
            config.add_column(column)
        for name, values in diff["config"].items():
            style = "yellow" if values["changed"] else ""
            config.add_row(name, str(values["a"]), str(values["b"]), style=style)
        ctx.console.print(config)
        modules = Table(title="modules (‖ΔW‖)")
        for column in ("module", diff["a"], diff["b"], "change"):
            modules.add_column(column)
        for m in diff["modules"]:
            one = (m["a"] or {}).get("delta_norm")
            two = (m["b"] or {}).get("delta_norm")
            change = m["delta_norm_change"]
            modules.add_row(
                m["module"],
                "-" if one is None else f"{one:.4f}",
                "-" if two is None else f"{two:.4f}",
                "-" if change is None else f"{change:+.4f}",
            )
        ctx.console.print(modules)
        for note in diff["notes"]:
            ctx.console.print(f"[dim]{escape(note)}[/]")

    ctx.emit(diff, render)
    return EXIT_OK


def cmd_lineage(ctx: Context) -> int:
    a = ctx.args
    lineage = ctx.client().lineage(a.adapter, a.revision)

    def render() -> None:
        chain = [x["revision"] for x in reversed(lineage["ancestors"])] + [lineage["revision"]]
        ctx.console.print(" → ".join(chain) + (" (older not shown)" if lineage["more_ancestors"] else ""))
        if lineage["children"]:
            ctx.console.print("children: " + ", ".join(c["revision"] for c in lineage["children"]))

    ctx.emit(lineage, render)
    return EXIT_OK


def cmd_download(ctx: Context) -> int:
    a = ctx.args
    try:
        written = ctx.client().download(a.adapter, a.revision, a.to)
    except errors.Conflict as exc:
        raise errors.Conflict(
            f"{a.adapter} r{str(a.revision).removeprefix('r')} has no exported files to download: {exc.message}",
            code=exc.code,
            status=exc.status,
        ) from exc
    ctx.emit([str(p) for p in written], lambda: ctx.console.print("\n".join(str(p) for p in written)))
    return EXIT_OK
