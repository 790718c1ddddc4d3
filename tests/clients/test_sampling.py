"""The SDK's rollout calls against httpx.MockTransport (the real node: tests/e2e/test_rl_rollouts.py): `sample`
keeps prompt order under concurrency, retries 503 and 429 after their Retry-After, parses token ids and
log-probabilities; `decode_routed_experts` reads vLLM's `.npy` without NumPy; `push(ready_to_sample=True)` waits
until the revision answers and stops on a failure."""

from __future__ import annotations

import base64
import io
import json
import random
import threading
import time

import httpx
import numpy as np
import pytest
from mint_client import Client, RevisionFailed, decode_routed_experts
from mint_client.cli import main

from tests.clients.test_retries import error


def completion(prompt: str, n: int, *, routed: str | None = None) -> dict:
    """What the gateway answers: n choices whose tokens are `token_id:<id>` (return_tokens_as_token_ids)."""
    choices = []
    for i in range(n):
        ids = [len(prompt), i, 7]
        choice = {
            "index": i,
            "text": f"{prompt}-{i}",
            "finish_reason": "length",
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": [-0.5, -1.0 - i, -2.0],
                "top_logprobs": None,
                "text_offset": [0, 1, 2],
            },
        }
        if routed is not None:
            choice["routed_experts"] = routed
        choices.append(choice)
    return {"object": "text_completion", "model": "m", "choices": choices, "usage": {"prompt_tokens": 3}}


def gateway(answer, *, retries: int = 3) -> tuple[Client, list[dict], list[float]]:
    """A client whose gateway answers each completion with `answer(body, attempt)`."""
    bodies: list[dict] = []
    slept: list[float] = []
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.read())
        with lock:
            bodies.append(body)
            attempt = sum(1 for b in bodies if b.get("prompt") == body.get("prompt"))
        return answer(body, attempt)

    client = Client(
        "http://mint.test", "mint_abc_def", transport=httpx.MockTransport(handler), sleep=slept.append, retries=retries
    )
    return client, bodies, slept


def test_samples_come_back_in_prompt_order_with_token_ids_and_logprobs():
    def answer(body, attempt):
        time.sleep(random.random() / 50)  # answers arrive out of order
        return httpx.Response(200, json=completion(body["prompt"], body["n"]))

    client, bodies, _ = gateway(answer)
    prompts = [f"p{i:02d}" + "x" * i for i in range(12)]
    samples = client.sample("policy", "r7", prompts, n=3, max_tokens=8, seed=100, concurrency=4)

    assert [(s.prompt_index, s.index) for s in samples] == [(p, i) for p in range(12) for i in range(3)]
    assert [s.text for s in samples[:3]] == ["p00-0", "p00-1", "p00-2"]
    assert samples[5].token_ids == [len(prompts[1]), 2, 7] and samples[5].logprobs == [-0.5, -3.0, -2.0]
    sent = sorted(bodies, key=lambda b: b["seed"])
    assert [b["seed"] for b in sent] == list(range(100, 136, 3))  # the engine seeds choice j with seed + j
    assert {b["model"] for b in sent} == {"policy@r7"}
    assert all(b["logprobs"] == 0 and b["return_tokens_as_token_ids"] is True for b in sent)
    assert all(b["n"] == 3 and b["max_tokens"] == 8 and "return_routed_experts" not in b for b in sent)


def test_a_cold_revision_is_retried_after_the_gateways_retry_after():
    def answer(body, attempt):
        if attempt == 1:
            return error(503, "adapter_not_ready", {"Retry-After": "2"})
        if attempt == 2:
            return error(429, "rate_limit_exceeded", {"Retry-After": "1"})
        return httpx.Response(200, json=completion(body["prompt"], 1))

    client, bodies, slept = gateway(answer)
    samples = client.sample("policy", 3, ["a", "b"], concurrency=2)
    assert [s.text for s in samples] == ["a-0", "b-0"]
    assert sorted(slept) == [1.0, 1.0, 2.0, 2.0] and len(bodies) == 6


def test_a_refusal_that_is_not_retried_raises():
    client, _, _ = gateway(lambda body, attempt: error(403, "revision_not_approved"))
    with pytest.raises(Exception) as refused:
        client.sample("policy", 3, ["a"])
    assert refused.value.code == "revision_not_approved"


def test_routed_experts_are_decoded_into_an_array_per_token():
    routing = np.random.default_rng(0).integers(0, 128, size=(5, 3, 2)).astype(np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, routing, allow_pickle=False)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    assert decode_routed_experts(encoded) == routing.tolist()
    wide = routing.astype(np.uint16) * 300
    buffer = io.BytesIO()
    np.save(buffer, wide, allow_pickle=False)
    assert decode_routed_experts(base64.b64encode(buffer.getvalue()).decode()) == wide.tolist()

    client, bodies, _ = gateway(lambda body, _: httpx.Response(200, json=completion(body["prompt"], 1, routed=encoded)))
    (sample,) = client.sample("moe", 2, ["a"], routed_experts=True, routed_experts_prompt_start=4)
    assert sample.routed_experts == routing.tolist()
    assert bodies[0]["return_routed_experts"] is True and bodies[0]["routed_experts_prompt_start"] == 4


def test_push_ready_to_sample_returns_once_the_revision_answers(tmp_path):
    from tests.adapters.corpus import TINY_DENSE, write_lora_adapter

    adapter_dir = write_lora_adapter(tmp_path / "a", TINY_DENSE, rank=4, alpha=8.0, targets=("q_proj",))
    probes: list[dict] = []
    registered: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        if request.url.path.endswith("/revisions/"):
            registered.append(request)
            return httpx.Response(201, json={"number": 4, "revision": "r4", "state": "registered"})
        if request.url.path == "/v1/completions":
            probes.append(json.loads(request.content))
            if len(probes) == 1:
                return error(403, "revision_not_exported")
            if len(probes) == 2:
                return error(503, "adapter_not_ready", {"Retry-After": "5"})
            return httpx.Response(200, json=completion("Hello", 1))
        return httpx.Response(200, json={"number": 4, "revision": "r4", "state": "exported", "run": "grpo"})

    slept: list[float] = []
    client = Client("http://mint.test", "mint_a_b", transport=httpx.MockTransport(handler), sleep=slept.append)
    revision = client.push(
        "policy", adapter_dir, training_step=4, run="grpo", metrics={"reward": 0.5}, ready_to_sample=True
    )

    assert (revision.label, revision.state) == ("r4", "exported")
    form = registered[0].content.decode(errors="replace")
    assert 'name="prewarm"\r\n\r\ntrue' in form and 'name="run"\r\n\r\ngrpo' in form
    assert '{"reward": 0.5}' in form
    assert len(probes) == 3 and probes[0] == {
        "model": "policy@r4",
        "prompt": "Hello",
        "max_tokens": 1,
        "temperature": 0,
    }
    assert all(s < 0.5 for s in slept)  # polled in tens of milliseconds, not the 503's Retry-After


def test_push_raises_when_the_revision_fails_validation(tmp_path):
    from tests.adapters.corpus import TINY_DENSE, write_lora_adapter

    adapter_dir = write_lora_adapter(tmp_path / "a", TINY_DENSE, rank=4, alpha=8.0, targets=("q_proj",))

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        if request.url.path.endswith("/revisions/"):
            return httpx.Response(201, json={"number": 2, "revision": "r2", "state": "registered"})
        if request.url.path == "/v1/completions":
            return error(403, "revision_not_sampleable")
        failure = {"code": "rank_too_high", "reason": "rank 64 > 16", "retryable": False}
        return httpx.Response(200, json={"number": 2, "revision": "r2", "state": "failed", "failure": failure})

    client = Client("http://mint.test", "mint_a_b", transport=httpx.MockTransport(handler), sleep=lambda s: None)
    with pytest.raises(RevisionFailed) as failed:
        client.push("policy", adapter_dir, ready_to_sample=True)
    assert failed.value.failure_code == "rank_too_high" and "rank 64 > 16" in str(failed.value)


def test_mint_sample_writes_json_lines(tmp_path, monkeypatch, capsys):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.read())
        return httpx.Response(200, json=completion(body["prompt"], body["n"]))

    real = httpx.Client

    def fake_client(*args, **kwargs):
        kwargs["transport"] = httpx.MockTransport(handler)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "Client", fake_client)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    out = tmp_path / "samples.jsonl"
    argv = ["sample", "policy", "r3", "--prompts", str(prompts), "--prompt", "zero", "-n", "2", "--seed", "1"]
    code = main([*argv, "--out", str(out), "--base-url", "http://mint.test", "--api-key", "mint_a_b"])
    assert code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["prompt_index"], line["index"], line["text"]) for line in lines] == [
        (0, 0, "zero-0"),
        (0, 1, "zero-1"),
        (1, 0, "one-0"),
        (1, 1, "one-1"),
        (2, 0, "two-0"),
        (2, 1, "two-1"),
    ]
    assert lines[0]["token_ids"] == [4, 0, 7] and lines[0]["logprobs"] == [-0.5, -1.0, -2.0]

    assert main(["sample", "policy", "r3", "--base-url", "http://mint.test", "--api-key", "mint_a_b"]) != 0
    assert "No prompts" in capsys.readouterr().err
