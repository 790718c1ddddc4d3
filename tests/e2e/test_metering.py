"""Metering against the real vLLM CPU engine (the session's), through the ASGI server and the official client.

Two revisions live (r1 as `production`, r2 by number), then 16 concurrent clients, each its own `openai.OpenAI`,
send a mix of completions, chats, and streamed completions and chats with and without
`stream_options.include_usage`. Every request asks `ignore_eos` with a fixed `max_tokens`, so the completion
tokens of a stream the client got no usage for are exactly its `max_tokens` (its last choice ends with
`length`; the answers that carry usage confirm it), and its prompt tokens are those a non-streamed twin of the
same prompt reported (the prompt's token count does not depend on the LoRA). The minute rows (and the hour and
day rollups) of kind `inference` must add up, per revision, to exactly the tokens and requests the clients saw:
first as written by a flush during traffic (MINT_GATEWAY_USAGE_FLUSH_S=1), then after a clean stop of the web
server (nothing counted twice), then for requests that only the stop's flush writes (a second server with a
flush interval of an hour). The prewarms' warm-ups are there as kind `warmup` and in none of the sums.

Without the engine: counts reach the database when traffic stops, not only at the next request.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
from django.db.models import Sum

from adapters.models import AdapterRevision
from serving.models import Alias, Placement, UsageKind, UsagePeriod, UsageRecord
from tenants.models import Tenant
from tests.e2e.world import register_peft_revisions, wait

pytestmark = [pytest.mark.e2e]

CLIENTS = 16
PER_CLIENT = 12  # 192 requests in the concurrent phase
PROMPTS = ("the quick brown fox", "hello", "a b c d e f g h", "tokens are counted once")
MODELS = {"support-bot": 1, "support-bot@r2": 2}  # model → the revision it resolves to
KINDS = ("completion", "chat", "stream_completion_usage", "stream_completion", "stream_chat_usage", "stream_chat")
SUMS = ("requests", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class Seen:
    """One answered request as its client saw it."""

    revision: int
    prompt_tokens: int
    completion_tokens: int


class Clients:
    """Sends requests through the gateway and keeps what each client saw, thread-safely."""

    def __init__(self, web: str, token: str):
        self.web, self.token = web, token
        self.prompt_tokens: dict[tuple[str, str], int] = {}  # (completion|chat, prompt) → from a non-streamed twin
        self.seen: list[Seen] = []
        self._lock = threading.Lock()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.web}/v1", api_key=self.token, max_retries=0, timeout=120)

    def send(self, client: openai.OpenAI, kind: str, model: str, prompt: str, max_tokens: int) -> Seen:
        form = "chat" if "chat" in kind else "completion"
        streamed, asks_usage = kind.startswith("stream"), kind.endswith("_usage")
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
        if streamed:
            common |= {"stream": True} | ({"stream_options": {"include_usage": True}} if asks_usage else {})
        if form == "chat":
            answer = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            answer = client.completions.create(prompt=prompt, **common)
        if not streamed:
            assert answer.choices[0].finish_reason == "length"
            seen = Seen(MODELS[model], answer.usage.prompt_tokens, answer.usage.completion_tokens)
            with self._lock:
                self.prompt_tokens.setdefault((form, prompt), seen.prompt_tokens)
        else:
            chunks = list(answer)
            usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
            finished = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
            assert finished == ["length"], finished
            if asks_usage:
                assert len(usages) == 1 and chunks[-1].usage is not None and not chunks[-1].choices, chunks[-1]
                seen = Seen(MODELS[model], usages[0].prompt_tokens, usages[0].completion_tokens)
            else:
                assert usages == [], "the client did not ask for usage and must not get it"
                seen = Seen(MODELS[model], self.prompt_tokens[(form, prompt)], max_tokens)
        # ignore_eos: every answer is exactly max_tokens long, and a prompt's tokens are the same in every form
        # that shares its template (what lets a stream without usage be counted from its twin).
        assert seen.completion_tokens == max_tokens, (kind, seen)
        assert seen.prompt_tokens == self.prompt_tokens.get((form, prompt), seen.prompt_tokens), (kind, seen)
        with self._lock:
            self.seen.append(seen)
        return seen

    def expected(self) -> dict[int, dict[str, int]]:
        """Per revision: requests, prompt and completion tokens the clients saw."""
        totals: dict[int, Counter] = {}
        for s in self.seen:
            total = totals.setdefault(s.revision, Counter())
            total.update({"requests": 1, "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens})
        return {revision: {name: total[name] for name in SUMS} for revision, total in totals.items()}


def metered(tenant, *, period: str = UsagePeriod.MINUTE, kind: str = UsageKind.INFERENCE) -> dict[int, dict]:
    """Per revision: what the usage rows of one period and kind hold for the tenant."""
    rows = (
        UsageRecord.objects.filter(tenant=tenant, period=period, kind=kind)
        .values("revision")
        .annotate(**{name: Sum(name) for name in SUMS})
    )
    return {row["revision"]: {name: row[name] for name in SUMS} for row in rows}


@pytest.mark.engine
def test_metered_tokens_equal_what_16_concurrent_openai_clients_saw(
    tenant_a, engine, tiny_llama_dir, artifact_root, tmp_path, make_serving_world, start_web, supervisor
):
    # A plan that refuses none of the test's requests: every one must be a 200 the clients can count.
    Tenant.objects.filter(id=tenant_a.tenant.id).update(rate_limit_rpm=100_000, max_inflight_requests=256)
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1", "MINT_GATEWAY_USAGE_FLUSH_S": "1"}
    world = make_serving_world(tenant_a.tenant, env)
    adapter, logs = world.adapter, world.logs

    pipeline, approver = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path)
    for number in (1, 2):
        assert pipeline.post(f"/api/v1/adapters/support-bot/revisions/{number}/request-approval/").status_code == 200
        assert (
            approver.post(f"/api/v1/adapters/support-bot/revisions/{number}/approve/", {}, format="json").status_code
            == 200
        )
    # r2 live first, then r1: both prewarmed by the node agent (no gateway request before both are ready).
    for number in (2, 1):
        revision = AdapterRevision.objects.get(adapter=adapter, number=number)
        assert (
            approver.post(
                "/api/v1/adapters/support-bot/activate/", {"revision": f"r{number}"}, format="json"
            ).status_code
            == 200
        )
        wait(
            lambda r=revision: Alias.objects.get(adapter=adapter, name="production").revision_id == r.id,
            timeout=90,
            what=f"alias flip to r{number}",
            logs=logs,
        )
    assert Placement.objects.filter(revision__adapter=adapter, state="ready").count() == 2

    key, token = tenant_a.key("inference")
    clients = Clients(world.web, token)
    client = clients.client()

    # Twins: each prompt's tokens, as a completion and as a chat, from answers that carry usage.
    for prompt in PROMPTS:
        clients.send(client, "completion", "support-bot", prompt, 1)
        clients.send(client, "chat", "support-bot", prompt, 1)

    # 16 concurrent clients, each its own openai client, every kind against both revisions.
    start = threading.Barrier(CLIENTS)

    def run(c: int) -> int:
        own = clients.client()
        start.wait()
        for i in range(PER_CLIENT):
            n = c * PER_CLIENT + i  # kind, revision, prompt and length vary independently over the 192
            kind, model = KINDS[n % 6], list(MODELS)[(n // 6) % 2]
            clients.send(own, kind, model, PROMPTS[(n // 12) % 4], 1 + (n // 3) % 8)
        return PER_CLIENT

    with ThreadPoolExecutor(CLIENTS) as pool:
        assert sum(pool.map(run, range(CLIENTS))) == CLIENTS * PER_CLIENT

    # Flushes run at most every MINT_GATEWAY_USAGE_FLUSH_S, at the end of a request: once that has passed, one
    # more request writes everything pending, itself included.
    time.sleep(1.5)
    clients.send(client, "completion", "support-bot@r2", PROMPTS[0], 2)
    expected = clients.expected()
    assert set(expected) == {1, 2}
    assert sum(e["requests"] for e in expected.values()) == 2 * len(PROMPTS) + CLIENTS * PER_CLIENT + 1
    wait(lambda: metered(tenant_a.tenant) == expected, timeout=30, what="the flush during traffic", logs=logs)

    # A clean stop (SIGTERM) flushes what is pending, here nothing: no count is written twice.
    supervisor.stop("web")
    assert metered(tenant_a.tenant) == expected

    # A server that would not flush for an hour: only its clean stop writes the last requests.
    web = start_web(env | {"MINT_GATEWAY_USAGE_FLUSH_S": "3600"})
    clients.web = web
    tail = clients.client()
    for n, kind in enumerate(KINDS):
        clients.send(tail, kind, list(MODELS)[n % 2], PROMPTS[n % len(PROMPTS)], 3)
    assert metered(tenant_a.tenant) == expected  # still in the new server's memory
    supervisor.stop("web")
    expected = clients.expected()
    assert metered(tenant_a.tenant) == expected, logs()

    # The rollups hold the same sums, and every row names the key and the node, all answered 200.
    assert metered(tenant_a.tenant, period=UsagePeriod.HOUR) == expected
    assert metered(tenant_a.tenant, period=UsagePeriod.DAY) == expected
    rows = UsageRecord.objects.filter(tenant=tenant_a.tenant, kind=UsageKind.INFERENCE)
    assert set(rows.values_list("key_id", "adapter_id", "adapter_name", "node", "status").distinct()) == {
        (key.id, adapter.id, "support-bot", "e2e", 200)
    }

    # The warm-ups of both prewarms are metered as MinT's own, with no key, and in none of the sums above.
    warmups = metered(tenant_a.tenant, kind=UsageKind.WARMUP)
    assert set(warmups) == {1, 2}, warmups
    for warmup in warmups.values():
        assert warmup["requests"] >= 1 and warmup["prompt_tokens"] > 0 and warmup["completion_tokens"] >= 1, warmup
    assert set(
        UsageRecord.objects.filter(tenant=tenant_a.tenant, kind=UsageKind.WARMUP).values_list("key_id", flat=True)
    ) == {0}


def test_a_count_is_written_within_flush_intervals_when_no_request_follows(tenant_a, start_web, supervisor):
    """A crash loses at most one flush interval of counts (issue 18): the last request before a quiet spell is
    written by the flush that comes due after it, not kept in memory until some later request ends."""
    web = start_web({"MINT_GATEWAY_USAGE_FLUSH_S": "1"})
    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):  # metered like any answer of a known tenant: status 404
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    rows = UsageRecord.objects.filter(tenant=tenant_a.tenant, period=UsagePeriod.MINUTE, status=404)
    deadline = time.monotonic() + 20  # twenty flush intervals
    while not rows.exists() and time.monotonic() < deadline:
        time.sleep(0.25)
    written_while_running = rows.exists()
    supervisor.stop("web")
    assert rows.values_list("requests", flat=True).get() == 1  # it was metered: the clean stop wrote it
    assert written_while_running, "the count stayed in the gateway's memory until its shutdown"
