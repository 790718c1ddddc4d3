"""`mint sample`: rollouts of a revision by number, as JSON lines (one per sample, in prompt order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mint_client import errors
from mint_client.cli.context import EXIT_OK, Context
from mint_client.sampling import write_jsonl


def read_prompts(prompts: list[str], path: str | None) -> list[str]:
    """`--prompt` values, then a file's: one prompt a line, or JSON lines with a `prompt` (`-` is stdin)."""
    found = list(prompts or [])
    if path:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    found.append(json.loads(line)["prompt"])
                except (ValueError, KeyError, TypeError):
                    raise errors.ValidationError(f"{path}:{number}: a JSON line needs a string `prompt`.") from None
            else:
                found.append(line)
    if not found:
        raise errors.ValidationError("No prompts: pass --prompt TEXT (again for more) or --prompts FILE.")
    return found


def cmd_sample(ctx: Context) -> int:
    a = ctx.args
    samples = ctx.client().sample(
        a.adapter,
        a.revision,
        read_prompts(a.prompt, a.prompts),
        n=a.n,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        seed=a.seed,
        logprobs=not a.no_logprobs,
        routed_experts=a.routed_experts,
        concurrency=a.concurrency,
    )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as handle:
            write_jsonl(samples, handle)
        ctx.say(f"{len(samples)} samples of {a.adapter} {a.revision} written to {a.out}")
    else:
        write_jsonl(samples, sys.stdout)
    return EXIT_OK
