"""The `mint` argument parser and the bash completion script made from it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from mint_client.cli import commands, keys, lifecycle, members, rollouts
from mint_client.cli.context import EXIT_OK, Context


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--base-url", default=default(None), help="MinT's URL (default: $MINT_BASE_URL)")
    parser.add_argument("--api-key", default=default(None), help="an API key mint_… (default: $MINT_API_KEY)")
    parser.add_argument("--json", action="store_true", default=default(False), help="print JSON for scripts")
    parser.add_argument(
        "--http-timeout", type=float, default=default(60.0), help="seconds per HTTP request (default 60)"
    )
    parser.add_argument(
        "--retries", type=int, default=default(4), help="retries of a call on 503, 429 or no answer (default 4)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mint", description="MinT from the command line: push LoRA revisions, govern and serve them."
    )
    _global_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)

    def command(name: str, handler: Callable[..., int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(handler=handler)
        return p

    def rev(p: argparse.ArgumentParser) -> None:
        p.add_argument("adapter")
        p.add_argument("revision", help="r<n> or n")

    def alias(p: argparse.ArgumentParser) -> None:
        p.add_argument("--alias", default=None, help="the alias (default production)")

    p = command("push", commands.cmd_push, "register a revision from an adapter directory or archive")
    p.add_argument("path", help="a PEFT adapter directory (adapter_config.json + .safetensors) or a .tar/.tar.gz/.zip")
    p.add_argument("--adapter", "-a", required=True)
    p.add_argument("--step", type=int, default=None, help="the training step")
    p.add_argument("--parent", default=None, help="the revision this one continues (r<n>)")
    p.add_argument("--allow-duplicate", action="store_true", help="register even if equal to an earlier revision")
    p.add_argument("--run", default=None, help="the training run this step is of (the runs API lists it)")
    p.add_argument("--metrics", default=None, help="what was measured at this step, JSON: '{\"reward\": 0.4}'")
    p.add_argument(
        "--ready-to-sample",
        action="store_true",
        help="place it as soon as it is exported and return once it answers a sample (an RL step)",
    )
    p.add_argument("--wait", action="store_true", help="wait until exported (and, with --activate, served)")
    p.add_argument("--approve", action="store_true", help="request approval and approve (four-eyes: --deploy-key)")
    p.add_argument("--comment", default="", help="the approval's comment")
    p.add_argument("--override-reason", default="", help="approve past the evaluation gate, saying why")
    p.add_argument("--activate", action="store_true", help="approve (as --approve) and activate")
    alias(p)
    p.add_argument("--canary", type=int, default=None, metavar="PERCENT", help="with --activate: a canary (1-50 %%)")
    p.add_argument("--deploy-key", default=None, help="a second person's deploy key to approve and activate with")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait (default 900)")

    p = command("sample", rollouts.cmd_sample, "sample a revision by number (before approval too): JSON lines")
    rev(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (again for more)")
    p.add_argument(
        "--prompts", default=None, help="a file of prompts, one a line or JSON lines with `prompt` (- stdin)"
    )
    p.add_argument("-n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="prompt i is seeded seed + i*n (each sample its own)")
    p.add_argument("--no-logprobs", action="store_true", help="leave out token ids and log-probabilities")
    p.add_argument("--routed-experts", action="store_true", help="the experts each token was routed to (MoE, R3)")
    p.add_argument("--concurrency", type=int, default=8, help="requests at once (default 8)")
    p.add_argument("--out", "-o", default=None, help="write the JSON lines to this file (default stdout)")

    p = command("status", commands.cmd_status, "an adapter's aliases and latest revisions")
    p.add_argument("adapter")
    command("adapters", commands.cmd_adapters, "the tenant's adapters")
    p = command("create-adapter", commands.cmd_create_adapter, "create an adapter on a base model")
    p.add_argument("name")
    p.add_argument("--base-model", required=True)
    p.add_argument("--description", default="")
    p = command("revisions", commands.cmd_revisions, "an adapter's revisions, newest first")
    p.add_argument("adapter")
    p.add_argument("--state", default=None, help="comma-separated states")
    p.add_argument("--limit", type=int, default=0, help="at most this many (default all)")
    p = command("show", commands.cmd_show, "one revision")
    rev(p)
    p = command("wait", commands.cmd_wait, "wait until a revision reaches a state")
    rev(p)
    p.add_argument("--state", default="exported")
    p.add_argument("--timeout", type=float, default=900.0)
    p = command("request-approval", commands.cmd_request_approval, "exported → pending_approval")
    rev(p)
    p = command("approve", commands.cmd_approve, "approve a pending revision (deploy key; four-eyes)")
    rev(p)
    p.add_argument("--comment", default="")
    p.add_argument("--override-reason", default="", help="approve past the evaluation gate, saying why")
    p = command("reject", commands.cmd_reject, "reject a pending revision")
    rev(p)
    p.add_argument("--comment", required=True, help="why (required)")
    p = command("retry", commands.cmd_retry, "retry a revision that failed for a platform reason")
    rev(p)
    p = command("activate", commands.cmd_activate, "activate a revision on an alias (it flips once ready)")
    rev(p)
    alias(p)
    p.add_argument("--canary", type=int, default=None, metavar="PERCENT", help="start a canary (1-50 %%)")
    p.add_argument("--wait", action="store_true", help="wait until the alias serves it")
    p.add_argument("--timeout", type=float, default=900.0)
    p = command("rollback", commands.cmd_rollback, "roll an alias back (to the previous, or a given, revision)")
    p.add_argument("adapter")
    p.add_argument("revision", nargs="?", default=None)
    alias(p)
    p.add_argument("--wait", action="store_true", help="wait until the alias serves it again")
    p.add_argument("--timeout", type=float, default=900.0)
    for name, handler, text in (
        ("promote", commands.cmd_promote, "flip an alias to its canary"),
        ("cancel", commands.cmd_cancel, "withdraw an alias's pending activation"),
    ):
        p = command(name, handler, text)
        p.add_argument("adapter")
        alias(p)
    p = command("abort", commands.cmd_abort, "drop an alias's canary")
    p.add_argument("adapter")
    alias(p)
    p.add_argument("--reason", default="")
    # The rest of an adapter's life (mint_client/cli/lifecycle.py).
    p = command("deactivate", lifecycle.cmd_deactivate, "take an alias down: its requests answer 404")
    p.add_argument("adapter")
    alias(p)
    p = command("archive", lifecycle.cmd_archive, "archive a revision no alias names (its files are removed)")
    rev(p)
    p.add_argument("--keep-source", action="store_true", help="keep its source so `mint restore` can bring it back")
    p.add_argument("--reason", default="")
    p = command("restore", lifecycle.cmd_restore, "restore an archived revision whose source was kept")
    rev(p)
    p = command("keep", lifecycle.cmd_keep, "mark a revision keep: retention never archives it")
    rev(p)
    p.add_argument("--off", action="store_true", help="unmark it")
    p = command("retention", lifecycle.cmd_retention, "an adapter's retention and its dry run; set it")
    p.add_argument("adapter")
    p.add_argument("--keep-last", type=int, default=None, help="keep the newest N exported revisions")
    p.add_argument("--grace-days", type=int, default=None, help="keep what an alias named within D days")
    p.add_argument("--plan", action="store_true", help="drop the adapter's own policy: the tenant plan's applies")
    p = command("edit-adapter", lifecycle.cmd_edit_adapter, "change an adapter's description and tags")
    p.add_argument("adapter")
    p.add_argument("--description", default=None)
    p.add_argument("--tag", action="append", default=None, help="a tag (repeat; replaces the tags)")
    p = command("delete-adapter", lifecycle.cmd_delete_adapter, "delete an adapter with no live alias")
    p.add_argument("adapter")
    p.add_argument("--yes", default=None, metavar="ADAPTER", help="the adapter's name again, to confirm")
    p = command("diff", lifecycle.cmd_diff, "two revisions side by side (config, modules, scores)")
    p.add_argument("adapter")
    p.add_argument("a", help="r<n>")
    p.add_argument("b", help="r<n>")
    p = command("lineage", lifecycle.cmd_lineage, "a revision's parent chain and children")
    rev(p)
    p = command("download", lifecycle.cmd_download, "fetch a revision's exported files")
    rev(p)
    p.add_argument("--to", default=".", help="the folder to write them to (default .)")
    p = command("logs", commands.cmd_logs, "the tenant's audit log (oldest of the last --limit first)")
    p.add_argument("--action", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--follow", "-f", action="store_true", help="keep polling for new events")
    p.add_argument("--interval", type=float, default=2.0)
    command("whoami", commands.cmd_whoami, "the key's tenant, scopes and capabilities")
    p = command("usage", commands.cmd_usage, "metered usage")
    p.add_argument("--from", dest="start", default=None)
    p.add_argument("--to", dest="end", default=None)
    p.add_argument("--group-by", default=None)
    p.add_argument("--adapter", default=None)
    p = command("eval-suite", commands.cmd_suite, "upload the next version of an adapter's evaluation suite (JSONL)")
    p.add_argument("adapter")
    p.add_argument("file")
    p = command("evaluation", commands.cmd_evaluation, "a revision's evaluation")
    rev(p)
    p = command("login", keys.cmd_login, "sign in as a person (password): a session for `mint keys`, kept 0600")
    p.add_argument("--username", "-u", default=None, help="who signs in (asked for when not given)")
    p.add_argument("--tenant", default=None, help="the tenant to act for, if you belong to several")
    p.add_argument("--password-stdin", action="store_true", help="read the password from stdin's first line")
    command("logout", keys.cmd_logout, "end the session `mint login` started and forget it")
    text = "the tenant's API keys: list, create, revoke (owners; after `mint login`)"
    p = sub.add_parser("keys", parents=[common], help=text, description=text)
    actions = p.add_subparsers(dest="keys_command", metavar="action", required=True)

    def key_action(name: str, handler: Callable[..., int], help: str) -> argparse.ArgumentParser:
        k = actions.add_parser(name, parents=[common], help=help, description=help)
        k.set_defaults(handler=handler)
        k.add_argument("--tenant", default=None, help="the tenant (default: the one chosen at `mint login`)")
        return k

    key_action("list", keys.cmd_keys_list, "the tenant's keys: live, revoked and expired")
    k = key_action("create", keys.cmd_keys_create, "create a key; its token is printed once")
    k.add_argument("name")
    k.add_argument("--scopes", required=True, help="comma-separated: pipeline, deploy, inference, sampling")
    k.add_argument("--expires", default=None, help="a duration (30d, 12h, 90m) or an ISO date or date-time")
    k.add_argument("--adapters", default=None, help="comma-separated adapters the key may call (default all)")
    k.add_argument("--max-tokens-per-minute", type=int, default=None, help="the key's own gateway limit")
    k.add_argument("--monthly-token-budget", type=int, default=None, help="the key's own monthly token budget")
    k = key_action("revoke", keys.cmd_keys_revoke, "revoke a key by its prefix (mint_<prefix>_…)")
    k.add_argument("prefix")
    text = "the tenant's people: list, invite, change a role, remove (owners; after `mint login`)"
    p = sub.add_parser("members", parents=[common], help=text, description=text)
    people = p.add_subparsers(dest="members_command", metavar="action", required=True)
    roles = ["owner", "approver", "developer", "viewer"]

    def member_action(name: str, handler: Callable[..., int], help: str) -> argparse.ArgumentParser:
        m = people.add_parser(name, parents=[common], help=help, description=help)
        m.set_defaults(handler=handler)
        m.add_argument("--tenant", default=None, help="the tenant (default: the one chosen at `mint login`)")
        return m

    member_action("list", members.cmd_members_list, "members with their role and last activity")
    m = member_action("invite", members.cmd_members_invite, "invite someone by email or username; the link is mailed")
    m.add_argument("who", help="an email address, or the username of an existing account")
    m.add_argument("--role", required=True, choices=roles)
    m = member_action("role", members.cmd_members_role, "change a member's role")
    m.add_argument("username")
    m.add_argument("role", choices=roles)
    m = member_action("remove", members.cmd_members_remove, "remove a member; the keys they made stop at once")
    m.add_argument("username")
    p = command("completion", cmd_completion, 'print a shell completion script: eval "$(mint completion bash)"')
    p.add_argument("shell", choices=["bash"])
    return parser


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion script for `mint`, from the parser itself (commands and each command's options)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        parsers = [p]
        actions = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        words = [w for a in actions for w in a.choices]  # `mint keys list|create|revoke`
        parsers += [q for a in actions for q in a.choices.values()]
        options = sorted({s for q in parsers for a in q._actions for s in a.option_strings if s.startswith("--")})
        cases.append(f'        {name}) opts="{" ".join(options)}" words="{" ".join(words)}" ;;')
    names = " ".join(sub.choices)
    return "\n".join(
        [
            '# mint bash completion: eval "$(mint completion bash)" (e.g. in ~/.bashrc)',
            "_mint() {",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" cmd="${COMP_WORDS[1]}" opts="" words=""',
            "    if [[ $COMP_CWORD -eq 1 ]]; then",
            f'        COMPREPLY=($(compgen -W "{names}" -- "$cur")); return',
            "    fi",
            '    case "$cmd" in',
            *cases,
            "    esac",
            '    if [[ $COMP_CWORD -eq 2 && -n "$words" && "$cur" != -* ]]; then',
            '        COMPREPLY=($(compgen -W "$words" -- "$cur")); return',
            "    fi",
            '    if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur"));',
            '    else COMPREPLY=($(compgen -f -- "$cur")); fi',
            "}",
            "complete -o filenames -F _mint mint",
        ]
    )


def cmd_completion(ctx: Context) -> int:
    print(bash_completion(build_parser()))
    return EXIT_OK
