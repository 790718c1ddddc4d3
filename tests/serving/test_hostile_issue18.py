"""Hostile review of issue 18 (usage metering, token limits and budgets): what a tenant can do to its own bill,
its limits, and the other tenants.

- A stream that ends before vLLM's last chunk (the client leaves, the stream reaches its time limit, the node
  breaks off) is billed the tokens it streamed: the gateway asks vLLM for running usage on every chunk and keeps
  it from clients that did not ask for it. Before, only the last chunk's totals counted, so a client that left
  just before it got every token for free, past its tokens-per-minute limit and monthly budget too.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from serving.gateway.upstream import UpstreamError
from serving.models import UsagePeriod, UsageRecord
from tests.serving.gateway_world import FakeAnswer, complete

pytestmark = pytest.mark.django_db(transaction=True)


def rows(**filters) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(period=UsagePeriod.MINUTE, **filters).order_by("status", "id"))


def data_events(answer) -> list[dict]:
    return [
        json.loads(line[5:])
        for line in answer.content.decode().splitlines()
        if line.startswith("data:") and line != "data: [DONE]"
    ]


# ---------------------------------------------------------------- streams that end before their last chunk


def _stream_without_its_end(world, *, then: str, choices: int = 1) -> list[dict]:
    """Make the node stream three tokens per choice (with running usage when the gateway asks for it), then
    never send its totals: it breaks off (`then="break"`) or goes quiet (`then="hang"`). Returns what was sent."""
    sent: list[dict] = []

    async def post(url: str, body: bytes) -> FakeAnswer:
        request = json.loads(body)
        sent.append(request)
        options = request.get("stream_options") or {}
        running = options.get("include_usage") and options.get("continuous_usage_stats")

        async def chunks():
            for i in range(1, 4):
                for index in range(choices):
                    chunk = {
                        "id": "cmpl-1",
                        "object": "text_completion",
                        "created": 1,
                        "model": request["model"],
                        "choices": [{"index": index, "text": f"t{i}", "finish_reason": None, "logprobs": None}],
                    }
                    if running:  # vLLM: the prompt's tokens and this choice's so far
                        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": i, "total_tokens": 5 + i}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
            if then == "break":
                raise UpstreamError("the node broke off the stream")
            await asyncio.sleep(3600)

        return FakeAnswer(200, content_type="text/event-stream", chunks=chunks)

    world.vllm.post = post
    return sent


def test_a_stream_the_node_breaks_off_before_its_totals_is_billed_what_it_streamed(world):
    sent = _stream_without_its_end(world, then="break")

    answer = complete(world, world.token, stream=True, max_tokens=16)

    assert answer.status == 200
    events = data_events(answer)
    assert [e["choices"][0]["text"] for e in events if e.get("choices")] == ["t1", "t2", "t3"]
    assert all("usage" not in e for e in events)  # the client asked for none
    assert sent[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    world.state.meter.flush()
    assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in rows()] == [(200, 5, 3)]


def test_a_stream_ended_at_its_time_limit_is_billed_what_it_streamed(world, settings):
    settings.MINT_GATEWAY_STREAM_MAX_S = 0.5
    _stream_without_its_end(world, then="hang")

    answer = complete(world, world.token, stream=True, max_tokens=16)

    assert answer.status == 200 and "stream_time_limit" in answer.content.decode()
    world.state.meter.flush()
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows()] == [(5, 3)]


def test_a_cut_stream_of_several_choices_bills_each_choice_and_the_prompt_once(world):
    _stream_without_its_end(world, then="break", choices=2)

    answer = complete(world, world.token, stream=True, max_tokens=16, n=2)

    assert answer.status == 200
    world.state.meter.flush()
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows()] == [(5, 6)]


def test_a_cut_stream_counts_against_the_tokens_per_minute_limit(world):
    type(world.tenant_a.tenant).objects.filter(id=world.tenant_a.tenant.id).update(max_tokens_per_minute=8)
    _stream_without_its_end(world, then="break")

    assert complete(world, world.token, stream=True, max_tokens=16).status == 200  # 8 tokens streamed
    second = complete(world, world.token, stream=True, max_tokens=16)

    assert second.status == 429 and second.error()["code"] == "tokens_per_minute_exceeded"


def test_a_client_asking_for_the_totals_only_still_gets_no_running_usage(world):
    answer = complete(world, world.token, stream=True, stream_options={"include_usage": True})

    events = data_events(answer)
    assert [e for e in events if e.get("usage")] == [e for e in events if not e.get("choices")]
    assert len([e for e in events if e.get("usage")]) == 1
    assert world.vllm.calls[-1][2]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_a_client_asking_for_running_usage_gets_it(world):
    answer = complete(
        world, world.token, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )

    events = data_events(answer)
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]
    world.state.meter.flush()
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows()] == [(3, 3)]
