"""`python -m devtools.live_check --key KEY`: put many adapters live on a running MinT and ask every one once.

What a customer with a thousand small adapters does, through the public API only (mint_client): for each of
`--adapters` adapters, create it, register a LoRA of its own, wait until it is exported, request approval,
approve and activate it (on demand: no reservation). Then wait until every alias serves, and send each one
completion request through the official `openai` client with its default settings (two retries, honouring
`Retry-After`), the least recently activated first, so that most of them are cold. Writes a JSON report:
how many answered, how many needed retries, the first request's time to completion, and what failed.

Against `make run` it needs a plan that fits the run: the demo tenant's `max_adapters` is 100, its
`max_revisions` 1,000 and its keys may write 60 times a minute, so raise them first (an operator's command,
audited as `tenant.update`):

    .venv/bin/python manage.py mint_tenant plan demo --set max_adapters=1100 --set max_revisions=1100 \\
        --set api_write_rpm=6000 --set api_tenant_write_rpm=6000

It is idempotent: adapters that exist already are reused, and a step already taken is not taken again, so a
run that stopped half-way goes on where it was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai

from devtools.django_setup import setup_django

DEFAULT_OUT = Path("var/live_check.json")


def prepare(mint: Any, name: str, base_model: str, adapter_dir: Path) -> str:
    """Bring adapter `name` to live on demand through the API; returns the revision label it activates."""
    from mint_client import NotFound

    try:
        adapter = mint.adapter(name)
    except NotFound:
        adapter = mint.create_adapter(name, base_model)
    live = adapter.alias("production")
    if live is not None and (live.revision or live.desired_revision):
        return live.desired_revision or live.revision
    revisions = list(mint.revisions(name))
    revision = revisions[0] if revisions else mint.register(name, adapter_dir)
    revision = mint.wait_for(name, revision.number, "exported", timeout=900)
    if revision.state == "exported":
        revision = mint.request_approval(name, revision.number)
    if revision.state == "pending_approval":
        mint.approve(name, revision.number, comment="live_check")
    mint.activate(name, revision.number)
    return f"r{revision.number}"


def wait_all_live(mint: Any, names: list[str], timeout: float) -> dict[str, str]:
    """Poll the adapter list until every alias serves what it was activated with; returns the ones that do not."""
    deadline = time.monotonic() + timeout
    wanted = set(names)
    while True:
        waiting: dict[str, str] = {}
        for adapter in mint.adapters(page_size=200):
            if adapter.name not in wanted:
                continue
            live = adapter.alias("production")
            if live is None or not live.revision or live.revision != live.desired_revision:
                waiting[adapter.name] = (live.reason or live.phase or "") if live is not None else "no alias"
        print(f"  {len(names) - len(waiting)} of {len(names)} aliases serve", flush=True)
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(5)


def ask(client: openai.OpenAI, name: str, statuses: list[int]) -> dict[str, Any]:
    """One completion for `name` with the client's default retries; what happened to it."""
    statuses.clear()
    started = time.monotonic()
    try:
        client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
    except openai.APIError as exc:
        code = getattr(exc, "code", None) or getattr(exc, "status_code", None) or type(exc).__name__
        return {"ok": False, "error": str(code), "s": time.monotonic() - started, "attempts": list(statuses)}
    return {"ok": True, "s": time.monotonic() - started, "attempts": list(statuses)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.live_check", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="MinT's address (make run's default).")
    parser.add_argument("--key", required=True, help="A key with the pipeline, deploy and inference scopes.")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--prefix", default="live-", help="Adapter names: <prefix>0000 … ")
    parser.add_argument("--base-model", default="tiny-llama")
    parser.add_argument("--threads", type=int, default=4, help="API calls in flight while preparing.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    from mint_client import Client

    setup_django()
    from devtools.demo_adapter import write_demo_adapter

    names = [f"{args.prefix}{i:04d}" for i in range(args.adapters)]
    mint = Client(base_url=args.url, api_key=args.key)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:

        def one(i: int) -> str:
            adapter_dir = Path(tmp) / names[i]
            write_demo_adapter(base_model=args.base_model, out=adapter_dir, seed=10_000 + i)
            return prepare(mint, names[i], args.base_model, adapter_dir)

        print(f"Preparing {len(names)} adapters on {args.url} …", flush=True)
        with ThreadPoolExecutor(args.threads) as pool:
            for done, _ in enumerate(pool.map(one, range(len(names))), 1):
                if done % 50 == 0 or done == len(names):
                    print(f"  {done} activated ({time.monotonic() - started:.0f} s)", flush=True)
    activated_s = time.monotonic() - started
    not_live = wait_all_live(mint, names, timeout=3600)
    live_s = time.monotonic() - started

    statuses: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]}, timeout=60)
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.key, http_client=http)
    print(f"Asking each of {len(names)} once …", flush=True)
    answers = {}
    for done, name in enumerate(names, 1):
        answers[name] = ask(client, name, statuses)
        if done % 100 == 0:
            ok = sum(a["ok"] for a in answers.values())
            print(f"  {done} asked, {ok} answered", flush=True)

    ok = [a for a in answers.values() if a["ok"]]
    first_try = [a for a in ok if a["attempts"] == [200]]
    result = {
        "benchmark": "live_check",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "adapters": len(names),
        "live_aliases": len(names) - len(not_live),
        "not_live": not_live,
        "answered": len(ok),
        "answered_ratio": len(ok) / len(names),
        "answered_first_try": len(first_try),
        "attempts": dict(Counter(len(a["attempts"]) for a in answers.values())),
        "errors": dict(Counter(a["error"] for a in answers.values() if not a["ok"])),
        "completion_p50_s": statistics.median(a["s"] for a in ok) if ok else None,
        "completion_p95_s": percentile([a["s"] for a in ok], 0.95),
        "retried_completion_p50_s": statistics.median(a["s"] for a in ok if a not in first_try)
        if len(ok) > len(first_try)
        else None,
        "prepare_s": round(activated_s, 1),
        "all_live_s": round(live_s, 1),
        "ask_s": round(time.monotonic() - started - live_s, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "not_live"}, indent=2))
    return 0 if result["answered"] == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
