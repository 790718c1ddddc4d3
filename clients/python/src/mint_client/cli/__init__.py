"""`mint`: the command line for training pipelines (argparse + rich; `--json` on every command for scripts).

Exit codes (clients/python/README.md has the table): 0 success, 1 any other error, 2 usage, 3 validation
failed, 4 refused by policy, 5 not found, 6 authentication, 7 network or timeout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

from rich.text import Text

from mint_client import errors
from mint_client.cli.context import EXIT_USAGE, Context, exit_code_for
from mint_client.cli.parser import build_parser
from mint_client.client import Client


def main(argv: Sequence[str] | None = None, *, make_client: Callable[..., Client] = Client) -> int:
    """Run one `mint` command; returns its exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    ctx = Context(args, make_client)
    try:
        return args.handler(ctx)
    except KeyboardInterrupt:
        return 130
    except (errors.MintError, ValueError, FileNotFoundError) as exc:
        exc = _explained(ctx, exc)
        code = EXIT_USAGE if isinstance(exc, FileNotFoundError) else exit_code_for(exc)
        if ctx.json:
            body = (
                exc.as_json()
                if isinstance(exc, errors.MintError)
                else {"error": {"code": "usage", "message": str(exc)}}
            )
            if isinstance(exc, errors.RevisionFailed):
                body["error"] |= {"failure_code": exc.failure_code, "failure_reason": exc.failure_reason}
            body["exit_code"] = code
            print(json.dumps(body, default=str))
        else:
            ctx.err.print(Text("error ", style="red") + Text(_human(exc)), soft_wrap=True)
        return code
    finally:
        ctx.close()


# The server names its API fields; a person at the command line reads the flags that set them.
_FLAGS = {"send allow_duplicate=true": "pass --allow-duplicate", "with allow_duplicate=true": "with --allow-duplicate"}


def _flags(text: str) -> str:
    for field, flag in _FLAGS.items():
        text = text.replace(field, flag)
    return text


def _explained(ctx: Context, exc: BaseException) -> BaseException:
    """The error as a person at the command line reads it: a bare "Not found." names what the command looked for
    (an adapter, or a revision of one that exists), and API fields are named by their flags."""
    if isinstance(exc, errors.NotFound) and exc.message.strip(" .").lower() in ("not found", ""):
        adapter = getattr(ctx.args, "adapter", None)
        revision = getattr(ctx.args, "revision", None)
        if adapter:
            message = f"No adapter named {adapter!r} in the tenant this key acts for."
            if revision is not None:
                try:
                    ctx.client().adapter(adapter)
                except errors.MintError:
                    pass
                else:
                    message = f"{adapter} has no r{str(revision).removeprefix('r')}."
            return errors.NotFound(message, code=exc.code, status=exc.status, detail=exc.detail)
    if isinstance(exc, errors.MintError) and "allow_duplicate=true" in exc.message:
        exc.message = _flags(exc.message)
    if isinstance(exc, errors.RevisionFailed):
        exc.failure_reason = _flags(exc.failure_reason)
    return exc


def _human(exc: BaseException) -> str:
    if isinstance(exc, errors.RevisionFailed):
        return f"validation failed: {exc.failure_code}: {exc.failure_reason}"
    return str(exc)


def run() -> None:
    sys.exit(main())
