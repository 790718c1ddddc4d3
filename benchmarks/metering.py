"""Metering under load: counted tokens ÷ the tokens the clients saw, and the lag until a request is in the rows.

On the private serving stack (benchmarks/stack.py, its own database and Redis database 11), two adapters are
live and 16 concurrent clients (each its own `openai.AsyncOpenAI`, one connection pool each) send, one request
after another, an even mix of completions, chats, and streamed completions and chats with and without
`stream_options.include_usage`, to both adapters, every request with `ignore_eos` and a `max_tokens` of 1-8.

- **Counted ÷ seen** (target exactly 1.0 for requests, prompt and completion tokens): what the clients saw is
  the `usage` of every answer that carries one; a stream that did not ask for usage carries none (checked), so
  its completion tokens are its `max_tokens` (`ignore_eos`, its choice ended `length`; every answer that carries
  usage confirms that equality) and its prompt tokens those of the non-streamed twin of the same prompt sent
  first. Counted: the sums of the `inference` minute rows of the tenant, per adapter, after the web server was
  stopped cleanly (SIGTERM, whose shutdown flushes what is pending). Rows with another status than 200 are
  reported apart (there should be none).
- **Flush lag** (target p95 ≤ the flush interval + 1 s): the time from a request's end, as its client saw it,
  until its count is in the database. Method: every request's end is stamped (`time.monotonic()`) by its
  client; a poller thread in the same process reads the minute rows' request total every 50 ms and stamps the
  moment each read returned. Only requests that ended in the first `--seconds` are measured, and the clients
  keep sending for two flush intervals more, so that every measured request is written by a flush that
  traffic brings due (the gateway flushes at the end of a request once MINT_GATEWAY_USAGE_FLUSH_S has passed
  since the last flush). The k-th measured request in order of its end counts as visible at the first read
  whose total is at least k (the total only grows); requests that end within a few milliseconds of each other
  may be recorded by the gateway in another order, which moves a lag by as much, against a lag of seconds.
  Resolution: the 50 ms poll plus one query.
- **Quiet tail**: after the last request, whether the counts still in the gateway's memory reach the database
  without another request (within three flush intervals), before the clean stop writes them.

Runs at MINT_GATEWAY_USAGE_FLUSH_S's default (10 s) unless `--flush-s`; quick: 1 s and a few seconds of load.

    python -m benchmarks.metering [--quick] [--seconds 60] [--flush-s 10] [--clients 16]
"""

from __future__ import annotations

import asyncio
import bisect
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import openai

from benchmarks.common import parser, percentile, summary_ms, write_result
from benchmarks.report.plots import plot_result
from benchmarks.stack import Stack

REDIS_DB = 11
PROMPTS = ("the quick brown fox", "hello", "a b c d e f g h", "tokens are counted once")
KINDS = ("completion", "chat", "stream_completion_usage", "stream_completion", "stream_chat_usage", "stream_chat")
ADAPTERS = ("meter-a", "meter-b")
POLL_S = 0.05
SUMS = ("requests", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class Seen:
    """One answered request as its client saw it, with the moment its answer ended."""

    adapter: str
    kind: str
    prompt_tokens: int
    completion_tokens: int
    started: float
    ended: float


def mix(n: int) -> tuple[str, str, str, int]:
    """The n-th request of a client's cycle: (kind, adapter, prompt, max_tokens); every kind with both adapters
    and every prompt, lengths 1-8."""
    return KINDS[n % 6], ADAPTERS[(n // 6) % 2], PROMPTS[(n // 12) % 4], 1 + (n // 3) % 8


class Mismatch(AssertionError):
    """An answer that breaks what the count of the tokens a client saw rests on."""


class Clients:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token
        self.twins: dict[tuple[str, str], int] = {}  # (completion|chat, prompt) → prompt tokens
        self.seen: list[Seen] = []
        self.errors: Counter = Counter()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.token, max_retries=0, timeout=120)

    async def send(self, client: openai.AsyncOpenAI, kind: str, adapter: str, prompt: str, max_tokens: int) -> None:
        form = "chat" if "chat" in kind else "completion"
        streamed, asks_usage = kind.startswith("stream"), kind.endswith("_usage")
        common = {"model": adapter, "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
        if streamed:
            common |= {"stream": True} | ({"stream_options": {"include_usage": True}} if asks_usage else {})
        started = time.monotonic()
        try:
            if form == "chat":
                answer = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            else:
                answer = await client.completions.create(prompt=prompt, **common)
            if streamed:
                chunks = [chunk async for chunk in answer]
        except openai.APIStatusError as exc:
            self.errors[exc.status_code] += 1
            return
        if not streamed:
            prompt_tokens, completion_tokens = answer.usage.prompt_tokens, answer.usage.completion_tokens
            finished = [answer.choices[0].finish_reason]
            self.twins.setdefault((form, prompt), prompt_tokens)
        else:
            usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
            finished = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
            if asks_usage:
                if len(usages) != 1 or chunks[-1].usage is None:
                    raise Mismatch(f"{kind}: asked for usage, got {usages}")
                prompt_tokens, completion_tokens = usages[0].prompt_tokens, usages[0].completion_tokens
            else:
                if usages:
                    raise Mismatch(f"{kind}: did not ask for usage and got {usages}")
                prompt_tokens, completion_tokens = self.twins[(form, prompt)], max_tokens
        if finished != ["length"] or completion_tokens != max_tokens:
            raise Mismatch(f"{kind}: finish {finished}, {completion_tokens} tokens for max_tokens {max_tokens}")
        if prompt_tokens != self.twins.get((form, prompt), prompt_tokens):
            raise Mismatch(f"{kind}: {prompt_tokens} prompt tokens, its twin had {self.twins[(form, prompt)]}")
        self.seen.append(Seen(adapter, kind, prompt_tokens, completion_tokens, started, time.monotonic()))

    async def load(self, clients: int, seconds: float) -> None:
        """`clients` concurrent clients sending the mix one request after another for `seconds`."""
        deadline = time.monotonic() + seconds

        async def run(c: int) -> None:
            client, n = self.client(), c * 7  # clients start at different points of the cycle
            async with client:
                while time.monotonic() < deadline:
                    await self.send(client, *mix(n))
                    n += 1

        await asyncio.gather(*(run(c) for c in range(clients)))

    async def twins_first(self) -> None:
        async with self.client() as client:
            for prompt in PROMPTS:
                for form in ("completion", "chat"):
                    await self.send(client, form, ADAPTERS[0], prompt, 1)

    async def one(self) -> None:
        async with self.client() as client:
            await self.send(client, "completion", ADAPTERS[0], PROMPTS[0], 1)

    def totals(self, adapter: str | None = None) -> dict[str, int]:
        seen = [s for s in self.seen if adapter in (None, s.adapter)]
        return {
            "requests": len(seen),
            "prompt_tokens": sum(s.prompt_tokens for s in seen),
            "completion_tokens": sum(s.completion_tokens for s in seen),
        }


class Poller(threading.Thread):
    """Reads the tenant's metered request total every POLL_S: (moment the read returned, total)."""

    def __init__(self, stack: Stack, tenant):
        super().__init__(daemon=True)
        self.stack, self.tenant = stack, tenant
        self.reads: list[tuple[float, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        from django.db import connection

        with self.stack.as_control_plane():
            try:
                while not self._done.is_set():
                    total = metered(self.tenant)["requests"]
                    self.reads.append((time.monotonic(), total))
                    self._done.wait(POLL_S)
            finally:
                connection.close()

    def stop(self) -> None:
        self._done.set()
        self.join()


def metered(tenant, adapter: str | None = None, *, status: int | None = 200) -> dict[str, int]:
    """The sums of the tenant's inference minute rows (of one adapter, of one status when given)."""
    from django.db.models import Sum

    from serving.models import UsageKind, UsagePeriod, UsageRecord

    rows = UsageRecord.objects.filter(tenant=tenant, period=UsagePeriod.MINUTE, kind=UsageKind.INFERENCE)
    rows = rows.filter(adapter_name=adapter) if adapter else rows
    rows = rows.filter(status=status) if status is not None else rows
    sums = rows.aggregate(**{name: Sum(name) for name in SUMS})
    return {name: int(sums[name] or 0) for name in SUMS}


def lags(ends: list[float], reads: list[tuple[float, int]], already: int) -> list[float | None]:
    """Each request's lag (seconds), the k-th end (sorted) matched to the first read with a total ≥ already + k."""
    totals = [total for _, total in reads]
    out: list[float | None] = []
    for k, ended in enumerate(sorted(ends), start=1):
        i = bisect.bisect_left(totals, already + k)
        out.append(reads[i][0] - ended if i < len(reads) else None)
    return out


def ratio(counted: int, seen: int) -> float | None:
    return round(counted / seen, 6) if seen else None


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--seconds", type=float, default=None, help="seconds of measured load (60; quick: 4)")
    p.add_argument("--flush-s", type=float, default=None, help="MINT_GATEWAY_USAGE_FLUSH_S (its default; quick: 1)")
    args = p.parse_args()
    seconds = args.seconds or (4.0 if args.quick else 60.0)
    flush_s = args.flush_s if args.flush_s is not None else (1.0 if args.quick else None)
    # The serving stack on Redis database REDIS_DB (benchmarks/stack.py's default is 13), at a chosen flush interval.
    extra = {"MINT_GATEWAY_USAGE_FLUSH_S": f"{flush_s:g}"} if flush_s is not None else {}
    with Stack("metering", redis_db=REDIS_DB, env=extra) as stack:
        from django.conf import settings

        interval = float(settings.MINT_GATEWAY_USAGE_FLUSH_S)
        tenant, token = stack.tenant()
        with stack.as_control_plane():
            for seed, name in enumerate(ADAPTERS, start=1):
                adapter, revision = stack.approved_revision(tenant, name, seed=seed)
                stack.activate(adapter, revision)
                stack.wait_live(adapter, revision)
        clients = Clients(stack.web_url, token)
        asyncio.run(clients.twins_first())
        asyncio.run(clients.load(args.clients, min(2.0, seconds)))  # warm connections, caches and the engine
        time.sleep(interval + 0.5)
        asyncio.run(clients.one())  # the flush that this request's end brings due writes all that is pending
        stack.wait(lambda: metered(tenant)["requests"] == len(clients.seen), what="warm-up written", timeout=60)
        already = len(clients.seen)

        poller = Poller(stack, tenant)
        poller.start()
        started = time.monotonic()
        measured_until = started + seconds
        keep_going = 2 * interval + 1
        asyncio.run(clients.load(args.clients, seconds + keep_going))
        load_s = time.monotonic() - started
        measured = [s for s in clients.seen[already:] if s.ended < measured_until]
        # The quiet tail: no request at all for three flush intervals.
        quiet_started = time.monotonic()
        quiet_wait = 3 * interval
        sent_200 = len(clients.seen)
        pending_at_end = sent_200 - metered(tenant)["requests"]
        while time.monotonic() - quiet_started < quiet_wait and metered(tenant)["requests"] < sent_200:
            time.sleep(POLL_S)
        poller.stop()
        pending_after_quiet = sent_200 - metered(tenant)["requests"]
        quiet_written_s = time.monotonic() - quiet_started if not pending_after_quiet else None

        stack.supervisor.stop("web")  # SIGTERM: the lifespan's shutdown flushes what is pending
        counted, seen = metered(tenant), clients.totals()
        other_statuses = metered(tenant, status=None)["requests"] - counted["requests"]
        per_adapter = {name: {"seen": clients.totals(name), "counted": metered(tenant, name)} for name in ADAPTERS}
        placement = stack.placement

    measured_lags = lags([s.ended for s in measured], poller.reads, already)
    visible = [lag for lag in measured_lags if lag is not None]
    lag_summary = summary_ms(visible) | {"max_ms": round(max(visible) * 1000, 3) if visible else None}
    width = max(interval / 20, POLL_S)
    histogram = Counter(int(lag // width) for lag in visible)
    changes = sum(1 for (_, a), (_, b) in zip(poller.reads, poller.reads[1:], strict=False) if b > a)
    figures = {
        "clients": args.clients,
        "seconds_measured": seconds,
        "seconds_of_load": round(load_s, 2),
        "flush_interval_s": interval,
        "requests_per_second": round((len(clients.seen) - already) / load_s, 2),
        "by_kind": dict(Counter(s.kind for s in clients.seen)),
        "client_errors": {str(k): v for k, v in clients.errors.items()},
        "seen": seen,
        "counted": counted,
        "counted_other_statuses": other_statuses,
        "per_adapter": per_adapter,
        "requests_ratio": ratio(counted["requests"], seen["requests"]),
        "prompt_ratio": ratio(counted["prompt_tokens"], seen["prompt_tokens"]),
        "completion_ratio": ratio(counted["completion_tokens"], seen["completion_tokens"]),
        "request_latency": summary_ms([s.ended - s.started for s in clients.seen[already:]]),
        "flush_lag": lag_summary | {"measured": len(measured), "never_visible": len(measured_lags) - len(visible)},
        "flush_lag_p95_s": round(percentile(visible, 95), 3) if visible else None,
        "flush_lag_histogram": {
            "bucket_s": width,
            "counts": [histogram.get(i, 0) for i in range(max(histogram, default=-1) + 1)],
        },
        "flushes_seen": changes,
        "quiet_tail": {
            "requests_pending_at_last_request": pending_at_end,
            "waited_s": round(quiet_wait, 2),
            "still_pending_after_wait": pending_after_quiet,
            "written_after_s": None if quiet_written_s is None else round(quiet_written_s, 3),
            "written_without_a_request": pending_after_quiet == 0,
        },
        "target": {"token_ratio": 1.0, "flush_lag_p95_s": interval + 1.0},
        "method": "client-stamped ends, rows' request total polled every 50 ms; see benchmarks/metering.py",
        "placement": placement,
        "benchmark_nice": os.getpriority(os.PRIO_PROCESS, 0),
    }
    path = write_result("metering", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
