"""The gateway's request allow-list against the real vLLM CPU engine (the session's), through the ASGI server.

One scenario, because a live adapter per tenant takes a while: the sampling fields a tenant may set reach
vLLM and take effect (max_tokens, stop, seed with temperature), an engine field (`request_id`) is refused
before it gets there, a chat request that bounds no tokens gets the plan's bound, answers carry no engine
extras, and two tenants sending at the same moment with the
same `X-Request-Id` header get distinct answer ids that owe nothing to it: the gateway forwards no header.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias
from tests.e2e.world import ServingWorld, register_peft_revisions, wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PROMPT = "the quick brown fox"
OPENAI_COMPLETION = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
OPENAI_CHOICE = {"index", "text", "logprobs", "finish_reason"}


def _make_live(world: ServingWorld, tenant, tiny_llama_dir, tmp_path, seed: int) -> None:
    """Register, approve and activate r1 of `world.adapter` for `tenant` (a peft adapter made with `seed`)."""
    name = world.adapter.name
    pipeline, approver = tenant.client_as("key:pipeline"), tenant.client_as("approver")
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path, seeds=(seed,))
    assert pipeline.post(f"/api/v1/adapters/{name}/revisions/1/request-approval/").status_code == 200
    assert approver.post(f"/api/v1/adapters/{name}/revisions/1/approve/", {}, format="json").status_code == 200
    activated = approver.post(f"/api/v1/adapters/{name}/activate/", {"revision": "r1"}, format="json")
    assert activated.status_code == 200, activated.content


def _serving(world: ServingWorld, client: openai.OpenAI) -> bool:
    r1 = AdapterRevision.objects.get(adapter=world.adapter, number=1)
    if Alias.objects.get(adapter=world.adapter, name="production").revision_id != r1.id:
        return False
    try:
        client.completions.create(model=world.adapter.name, prompt=PROMPT, max_tokens=1)
    except openai.APIStatusError:
        return False  # not ready in the gateway's route cache yet
    return True


def _text(client: openai.OpenAI, model: str, **fields) -> openai.types.Completion:
    extra = {k: fields.pop(k) for k in ("ignore_eos",) if k in fields}
    return client.completions.create(model=model, prompt=PROMPT, extra_body=extra or None, **fields)


def test_the_gateway_forwards_what_a_tenant_may_set_and_nothing_else(
    tenant_a, tenant_b, engine, tiny_llama_dir, artifact_root, tmp_path, make_serving_world
):
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1"}
    acme = make_serving_world(tenant_a.tenant, env)
    globex = ServingWorld(
        adapter=Adapter.objects.create(tenant=tenant_b.tenant, name="globex-bot", base_model=acme.adapter.base_model),
        node=acme.node,
        web=acme.web,
        logs=acme.logs,
    )
    _make_live(acme, tenant_a, tiny_llama_dir, tmp_path, seed=1)
    _make_live(globex, tenant_b, tiny_llama_dir, tmp_path, seed=2)
    token_a, token_b = tenant_a.key("inference")[1], tenant_b.key("inference")[1]
    client = openai.OpenAI(base_url=f"{acme.web}/v1", api_key=token_a, max_retries=0, timeout=60)
    other = openai.OpenAI(base_url=f"{acme.web}/v1", api_key=token_b, max_retries=0, timeout=60)
    wait(lambda: _serving(acme, client), timeout=120, what="support-bot served", logs=acme.logs)
    wait(lambda: _serving(globex, other), timeout=120, what="globex-bot served", logs=acme.logs)

    # max_tokens (with ignore_eos, so that the tiny model cannot stop early) is honoured.
    for max_tokens in (3, 5):
        answer = _text(client, "support-bot", max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert answer.usage.completion_tokens == max_tokens
        assert answer.choices[0].finish_reason == "length"
        assert answer.system_fingerprint is None

    # stop: the greedy text ends right before the first occurrence of the stop string.
    full = _text(client, "support-bot", max_tokens=16, temperature=0, ignore_eos=True).choices[0].text
    stop = next((c for c in full[1:] if c.isalnum()), None)
    assert stop is not None, f"no letter to stop on in {full!r}"
    stopped = _text(client, "support-bot", max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert stopped.choices[0].text == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    # seed with temperature: the same seed samples the same text; different seeds do not all agree.
    sampled = {seed: _text(client, "support-bot", max_tokens=8, temperature=1.0, seed=seed) for seed in (1, 2, 3)}
    again = _text(client, "support-bot", max_tokens=8, temperature=1.0, seed=1)
    assert again.choices[0].text == sampled[1].choices[0].text
    assert len({a.choices[0].text for a in sampled.values()}) > 1

    # A chat request that bounds no tokens is bounded by the plan (the engine would run to its context's end).
    tenant = tenant_a.tenant
    tenant.max_request_tokens = 6
    tenant.save(update_fields=["max_request_tokens"])

    def chat_tokens() -> int:
        answer = client.chat.completions.create(
            model="support-bot",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return answer.usage.completion_tokens

    wait(lambda: chat_tokens() == 6, timeout=30, what="the plan's token bound applied", logs=acme.logs)

    # An engine field is refused by the gateway, naming it, before any node sees it.
    for field, value in (("request_id", "fixed"), ("priority", -10)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="support-bot", prompt=PROMPT, max_tokens=2, extra_body={field: value})
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "unsupported_parameter", error
        assert f"`{field}`" in error["message"]

    # What vLLM really answers, as the caller gets it: OpenAI's fields only.
    raw = httpx.post(
        f"{acme.web}/v1/completions",
        json={"model": "support-bot", "prompt": PROMPT, "max_tokens": 2, "logprobs": 1},
        headers={"Authorization": f"Bearer {token_a}"},
        timeout=60,
    ).json()
    assert set(raw) == OPENAI_COMPLETION, raw
    assert set(raw["choices"][0]) == OPENAI_CHOICE, raw

    # Two tenants at the same moment, each with X-Request-Id: fixed.
    def completion_id(model_and_token: tuple[str, str]) -> str:
        model, token = model_and_token
        answer = httpx.post(
            f"{acme.web}/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 4},
            headers={"Authorization": f"Bearer {token}", "X-Request-Id": "fixed"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["id"]

    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(completion_id, [("support-bot", token_a), ("globex-bot", token_b)]))
    assert len(set(ids)) == 2, ids
    assert not any("fixed" in i for i in ids), ids
