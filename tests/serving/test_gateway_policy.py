"""The gateway's request allow-list and OpenAI-only answers (serving/gateway/policy/), vLLM faked at the HTTP edge.

Refused fields never reach a node; allowed ones reach it exactly as sent; the tenant's plan bounds tokens,
choices, log probabilities and structured-output constraints; answers keep OpenAI's fields only.
"""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from serving.gateway import GatewayError
from serving.gateway.auth import GatewayPlan
from serving.gateway.policy.fields import check_request
from serving.gateway.upstream import Upstream
from serving.models import ServingNode
from tenants import services as tenant_services
from tenants.access import Actor
from tests.serving.gateway_world import FakeAnswer, call, gateway_state, settle, site
from tests.serving.sockets import Server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def world(transactional_db, world):
    """The gateway's test world on committed rows (the gateway reads them on its own threads); the tests of
    `check_request` alone need no database."""
    return world


def send(world, path: str, **fields):
    """POST `fields` (with the model and, for chat, a message, unless given) as tenant A."""
    body = {"model": "support-bot"} | ({"messages": HELLO} if path == CHAT else {"prompt": "Hi"}) | fields
    return call(world, "POST", path, world.token, body)


def refusal(path: str, body: dict, plan: GatewayPlan | None = None) -> GatewayError:
    """What `check_request` raises for `body`, straight, without a gateway around it."""
    with pytest.raises(GatewayError) as caught:
        check_request(path, body, plan or GatewayPlan())
    assert caught.value.status == 400
    return caught.value


def refused(answer, code: str, *names: str) -> str:
    """The message of a 400 with `code`, after checking it names each of `names`."""
    assert answer.status == 400, answer.content
    error = answer.error()
    assert error["code"] == code, error
    assert error["type"] == "invalid_request_error"
    for name in names:
        assert name in error["message"], error
    return error["message"]


def set_plan(world, **limits: int) -> None:
    tenant_services.tenant_update(tenant=world.tenant_a.tenant, changes=limits, by=Actor.system())


def forwarded(world) -> dict:
    """The one body the node received, with the gateway's LoRA name back to the caller's model."""
    [(_, _, sent)] = world.vllm.calls
    assert sent["model"] == world.lora
    return sent | {"model": "support-bot"}


# ---------------------------------------------------------------------------------------------
# Fields a tenant may not set


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", -100),
        ("request_id", "fixed"),
        ("session_id", "s"),
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("vllm_xargs", {"k": "v"}),
        ("cache_salt", "salt"),
        ("return_token_ids", True),
        ("prompt_embeds", "AAAA"),
        ("prompt_logprobs", 1),
        ("use_beam_search", True),
        ("allowed_token_ids", [1]),
        ("thinking_token_budget", 5),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("messages", HELLO),
        ("priority", None),  # a null is no way around: the field itself is refused
    ],
)
def test_engine_and_unknown_fields_are_refused_on_completions_naming_the_field(world, field, value):
    message = refused(send(world, COMPLETIONS, **{field: value}), "unsupported_parameter", f"`{field}`")

    assert "/v1/completions" in message
    assert world.vllm.calls == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template", "{{ 7 * 7 }}"),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("mm_processor_kwargs", {"size": 1}),
        ("media_io_kwargs", {"image": {}}),
        ("documents", [{"title": "t", "text": "x"}]),
        ("request_id", "fixed"),
        ("priority", 1),
        ("echo", True),
        ("include_reasoning", False),
        ("functions", [{"name": "f"}]),
        ("prompt", "Hi"),
        ("x" * 500, 1),
    ],
)
def test_engine_and_unknown_fields_are_refused_on_chat_naming_the_field(world, field, value):
    refused(send(world, CHAT, **{field: value}), "unsupported_parameter", f"`{field[:100]}")

    assert world.vllm.calls == []


def test_a_refusal_says_why_where_the_field_has_a_reason():
    """The reason given for an engine setting, a removed vLLM field and the other endpoint's field."""
    reasons = {}
    for path, field in ((CHAT, "priority"), (COMPLETIONS, "guided_regex"), (CHAT, "prompt"), (CHAT, "nope")):
        reasons[field] = refusal(path, {field: 1}).message
    assert "setting of the serving engine" in reasons["priority"]
    assert "structured_outputs" in reasons["guided_regex"]
    assert "belongs to /v1/completions" in reasons["prompt"]
    assert "Gateway request fields" in reasons["nope"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://169.254.169.254/"}},
        {"type": "file", "file": {"file_id": "x"}},
        {"image_url": {"url": "http://example.com/a.png"}},  # vLLM infers the type from the key
        {"type": "text", "text": "Hi", "image_url": {"url": "http://example.com/a.png"}},
    ],
)
def test_a_message_part_that_is_not_plain_text_is_refused(world, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]

    refused(send(world, CHAT, messages=messages), "unsupported_parameter", "messages[0].content[1]")

    assert world.vllm.calls == []


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "max_tokens", "4"),
        (COMPLETIONS, "max_tokens", True),
        (COMPLETIONS, "max_tokens", 4.0),
        (COMPLETIONS, "temperature", "hot"),
        (COMPLETIONS, "temperature", False),
        (COMPLETIONS, "seed", "7"),
        (COMPLETIONS, "n", 0),
        (COMPLETIONS, "logprobs", -1),  # "every token" to vLLM
        (COMPLETIONS, "stop", 3),
        (COMPLETIONS, "stop", ["a", 3]),
        (COMPLETIONS, "stream", "yes"),
        (COMPLETIONS, "logit_bias", {"50": "up"}),
        (COMPLETIONS, "stop_token_ids", [-1]),
        (COMPLETIONS, "prompt", [1, "a"]),
        (COMPLETIONS, "prompt", []),
        (COMPLETIONS, "prompt", {"text": "Hi"}),
        (CHAT, "messages", "Hi"),
        (CHAT, "messages", []),
        (CHAT, "messages[0].role", [{"role": "wizard", "content": "Hi"}]),
        (CHAT, "messages[0].role", [{"content": "Hi"}]),
        (CHAT, "messages[0].content", [{"role": "user", "content": 7}]),
        (CHAT, "logprobs", 3),  # a boolean on chat
        (CHAT, "top_logprobs", "2"),
        (CHAT, "tool_choice", "sometimes"),
        (CHAT, "response_format.type", {"type": "yaml"}),
    ],
)
def test_a_value_of_the_wrong_type_is_400_naming_the_field(path, field, value):
    body_field = field.split("[")[0].split(".")[0]

    error = refusal(path, {"model": "m", body_field: value})

    assert error.code == "invalid_parameter"
    assert error.message.startswith(f"`{field}`")


def test_a_value_of_the_wrong_type_never_reaches_the_node(world):
    refused(send(world, COMPLETIONS, max_tokens="4"), "invalid_parameter", "`max_tokens`")

    assert world.vllm.calls == []


def test_a_message_with_a_key_openai_does_not_have_is_refused_by_name(world):
    messages = [{"role": "user", "content": "Hi", "reasoning": "secret"}]

    refused(send(world, CHAT, messages=messages), "unsupported_parameter", "`messages[0].reasoning`")


# ---------------------------------------------------------------------------------------------
# Fields a tenant may set: forwarded exactly as sent


def test_allowed_completion_fields_reach_the_node_unchanged(world):
    body = {
        "model": "support-bot",
        "prompt": ["Hi", "Bye"],
        "max_tokens": 7,
        "n": 2,
        "best_of": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 42,
        "stop": ["\n", "END"],
        "stop_token_ids": [2],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": True,
        "echo": False,
        "suffix": None,
        "logprobs": 3,
        "return_tokens_as_token_ids": True,  # the sampled tokens' ids, in the log-probabilities (RL rollouts)
        "logit_bias": {"50256": -100},
        "user": "customer-17",
        "stream": False,
        "response_format": {"type": "json_object"},
    }

    answer = call(world, "POST", COMPLETIONS, world.token, body)

    assert answer.status == 200, answer.content
    assert forwarded(world) == body


def test_allowed_chat_fields_reach_the_node_unchanged(world):
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {
        "model": "support-bot",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "No jokes."}]},
            {"role": "user", "content": "Weather in Oslo?", "name": "kari"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        "max_completion_tokens": 16,
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": weather}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "add_generation_prompt": True,
        "continue_final_message": False,
        "structured_outputs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "seed": 1,
    }

    answer = call(world, "POST", CHAT, world.token, body)

    assert answer.status == 200, answer.content
    # Metering asks every stream's running usage too (kept from a client that did not ask for it).
    assert forwarded(world) == body | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def test_a_request_at_every_plan_limit_is_forwarded(world):
    set_plan(world, max_request_tokens=8, max_choices=2, max_logprobs=1)

    answer = send(world, COMPLETIONS, max_tokens=8, n=2, logprobs=1)

    assert answer.status == 200, answer.content
    assert forwarded(world)["max_tokens"] == 8


def test_a_chat_request_without_a_token_bound_gets_the_plans(world):
    """Left to the engine it would run to the end of the node's context window."""
    set_plan(world, max_request_tokens=12)

    answer = send(world, CHAT)

    assert answer.status == 200, answer.content
    assert forwarded(world)["max_completion_tokens"] == 12


@pytest.mark.parametrize("given", [{"max_tokens": 5}, {"max_completion_tokens": 5}])
def test_a_chat_request_with_its_own_token_bound_keeps_it(world, given):
    answer = send(world, CHAT, **given)

    assert answer.status == 200, answer.content
    assert forwarded(world) == {"model": "support-bot", "messages": HELLO} | given


def test_a_completion_without_max_tokens_keeps_the_engines_default_of_16(world):
    answer = send(world, COMPLETIONS)

    assert answer.status == 200, answer.content
    assert "max_tokens" not in forwarded(world)


# ---------------------------------------------------------------------------------------------
# The plan's bounds


@pytest.mark.parametrize(
    ("path", "fields", "code", "named", "limit"),
    [
        (COMPLETIONS, {"max_tokens": 9}, "max_tokens_too_large", "`max_tokens` is 9", "8 (max_request_tokens)"),
        (CHAT, {"max_tokens": 9}, "max_tokens_too_large", "`max_tokens` is 9", "8 (max_request_tokens)"),
        (
            CHAT,
            {"max_completion_tokens": 9},
            "max_tokens_too_large",
            "`max_completion_tokens` is 9",
            "8 (max_request_tokens)",
        ),
        (COMPLETIONS, {"n": 3}, "too_many_choices", "`n` is 3", "2 (max_choices)"),
        (CHAT, {"n": 3}, "too_many_choices", "`n` is 3", "2 (max_choices)"),
        (COMPLETIONS, {"best_of": 3}, "too_many_choices", "`best_of` is 3", "2 (max_choices)"),
        (COMPLETIONS, {"logprobs": 2}, "too_many_logprobs", "`logprobs` is 2", "1 (max_logprobs)"),
        (CHAT, {"logprobs": True, "top_logprobs": 2}, "too_many_logprobs", "`top_logprobs` is 2", "1 (max_logprobs)"),
    ],
)
def test_a_value_over_the_tenants_plan_is_400_naming_the_field_the_value_and_the_limit(
    world, path, fields, code, named, limit
):
    set_plan(world, max_request_tokens=8, max_choices=2, max_logprobs=1)

    message = refused(send(world, path, **fields), code, named, f"at most {limit}")

    assert message.startswith(named)
    assert world.vllm.calls == []


def test_the_plan_of_the_callers_tenant_applies_not_another_tenants(world):
    set_plan(world, max_request_tokens=8)
    other = call(
        world,
        "POST",
        COMPLETIONS,
        world.tenant_b.key("inference")[1],
        {"model": "globex-bot", "prompt": "Hi", "max_tokens": 100},
    )

    assert other.status == 200, other.content
    assert send(world, COMPLETIONS, max_tokens=100).error()["code"] == "max_tokens_too_large"


def test_a_list_of_prompts_counts_each_prompt_times_n_against_max_choices(world):
    set_plan(world, max_choices=4)

    assert send(world, COMPLETIONS, prompt=["a", "b"], n=2).status == 200
    refused(send(world, COMPLETIONS, prompt=["a", "b", "c"], n=2), "too_many_choices", "3 prompts", "6 choices")
    refused(send(world, COMPLETIONS, prompt=[[1, 2]] * 5), "too_many_choices", "5 prompts")
    assert send(world, COMPLETIONS, prompt=list(range(50))).status == 200  # one prompt of 50 token ids
    assert len(world.vllm.calls) == 2


def test_best_of_other_than_n_is_refused_because_the_engine_ignores_it(world):
    refused(send(world, COMPLETIONS, best_of=2), "unsupported_parameter", "`best_of` is 2", "`n` is 1")
    assert send(world, COMPLETIONS, best_of=1).status == 200


# ---------------------------------------------------------------------------------------------
# Structured outputs


def _schema_of_size(size: int) -> dict:
    """A response_format that serializes to exactly `size` bytes (compact JSON, as the gateway measures)."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": ""}}}
    padding = size - len(json.dumps(rf, separators=(",", ":")))
    rf["json_schema"]["schema"]["description"] = "d" * padding
    return rf


def test_structured_outputs_up_to_the_plans_bytes_are_forwarded_and_one_byte_more_is_refused(world):
    set_plan(world, max_structured_output_bytes=300)

    assert send(world, CHAT, response_format=_schema_of_size(300)).status == 200
    message = refused(
        send(world, CHAT, response_format=_schema_of_size(301)),
        "structured_output_too_large",
        "`response_format`",
        "301 bytes",
        "at most 300 (max_structured_output_bytes)",
    )
    assert "take" in message
    assert forwarded(world)["response_format"] == _schema_of_size(300)


def test_structured_output_constraints_of_one_request_are_summed(world):
    set_plan(world, max_structured_output_bytes=100)
    regex = {"regex": "[a-z]{1,40}"}
    regex_bytes = len(json.dumps(regex, separators=(",", ":")))
    assert send(world, COMPLETIONS, structured_outputs=regex).status == 200

    answer = send(world, COMPLETIONS, structured_outputs=regex, response_format=_schema_of_size(100 - regex_bytes + 1))

    refused(answer, "structured_output_too_large", "`response_format`", "`structured_outputs`", "101 bytes")


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"response_format": {"type": "json_object"}}),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}),
        (COMPLETIONS, {"structured_outputs": {"choice": ["yes", "no"]}}),
        (COMPLETIONS, {"structured_outputs": {"grammar": 'root ::= "a"'}}),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ],
)
def test_a_plan_with_no_structured_output_bytes_refuses_every_constraint(world, path, fields):
    set_plan(world, max_structured_output_bytes=0)

    refused(send(world, path, **fields), "structured_output_not_allowed", f"`{next(iter(fields))}`")
    assert world.vllm.calls == []


def test_a_plain_text_response_format_is_no_constraint(world):
    set_plan(world, max_structured_output_bytes=0)

    assert send(world, CHAT, response_format={"type": "text"}).status == 200


def test_an_unknown_structured_output_option_is_refused_by_name(world):
    refused(
        send(world, COMPLETIONS, structured_outputs={"regex": "a", "_backend": "outlines"}),
        "unsupported_parameter",
        "`structured_outputs._backend`",
    )


# ---------------------------------------------------------------------------------------------
# Answers: OpenAI's fields only

VLLM_COMPLETION = {  # as vLLM 0.32 writes it (model_dump_json: every field, nulls included)
    "id": "cmpl-abc",
    "object": "text_completion",
    "created": 1700000000,
    "model": "LORA",
    "choices": [
        {
            "index": 0,
            "text": "Hello!",
            "logprobs": {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["Hello"], "top_logprobs": [None]},
            "finish_reason": "stop",
            "stop_reason": "END",
            "token_ids": [1, 2],
            "prompt_logprobs": [None, {"5": {"logprob": -1.0}}],
            "prompt_token_ids": [5, 6],
            "routed_experts": None,
        }
    ],
    "service_tier": None,
    "system_fingerprint": "vllm-0.32.0-node-a",
    "usage": {
        "prompt_tokens": 2,
        "total_tokens": 4,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 1, "created_cache_tokens": 1, "multimodal_tokens": None},
    },
    "kv_transfer_params": {"remote_host": "10.0.0.7"},
    "ec_transfer_params": None,
    "metrics": {"queue_time_ms": 3.0},
}

VLLM_CHAT = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "LORA",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Rain.",
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                "reasoning": "the user wants weather",
                "reasoning_content": "the user wants weather",
            },
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
    ],
    "service_tier": None,
    "system_fingerprint": None,
    "usage": {"prompt_tokens": 9, "total_tokens": 11, "completion_tokens": 2, "prompt_tokens_details": None},
    "prompt_logprobs": None,
    "prompt_token_ids": [1, 2, 3],
    "prompt_text": "<s>[INST] Weather? [/INST]",
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}


def _answering(world, answer: FakeAnswer) -> None:
    world.vllm.answers["node-a.test"] = answer


def test_a_completion_keeps_openais_fields_only_and_no_system_fingerprint(world):
    _answering(world, FakeAnswer(200, json_body=VLLM_COMPLETION))

    answer = send(world, COMPLETIONS, logprobs=1).json()

    assert set(answer) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    assert answer["system_fingerprint"] is None
    assert answer["model"] == "support-bot"
    [choice] = answer["choices"]
    assert choice == {k: VLLM_COMPLETION["choices"][0][k] for k in ("index", "text", "logprobs", "finish_reason")}
    assert answer["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 4,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_a_chat_completion_keeps_openais_fields_and_drops_reasoning_and_prompt_extras(world):
    _answering(world, FakeAnswer(200, json_body=VLLM_CHAT))

    answer = send(world, CHAT).json()

    assert set(answer) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "service_tier",
        "system_fingerprint",
    }
    [choice] = answer["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    message = choice["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert message["content"] == "Rain."
    assert message["tool_calls"] == VLLM_CHAT["choices"][0]["message"]["tool_calls"]


def _events(*payloads) -> FakeAnswer:
    text = "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)
    return FakeAnswer(200, content_type="text/event-stream", content=text.encode())


def test_stream_chunks_keep_openais_fields_only(world):
    chunk = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": world.lora}
    first = chunk | {
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
        "prompt_token_ids": [1, 2, 3],
        "prompt_text": "<s>Hi",
    }
    middle = chunk | {
        "choices": [{"index": 0, "delta": {"content": "Hel", "reasoning": "hm"}, "token_ids": [7], "stop_reason": None}]
    }
    last = chunk | {
        "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop", "stop_reason": 2}],
        "system_fingerprint": "vllm-0.32.0",
        "metrics": {"tokens_per_second": 9.0},
    }
    usage = chunk | {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    error = {"error": {"message": f"{world.lora} ran out of memory", "type": "InternalServerError", "code": 500}}
    _answering(world, _events(first, middle, last, usage, error, "[DONE]"))

    answer = send(world, CHAT, stream=True, stream_options={"include_usage": True})

    events = [e.removeprefix("data: ") for e in answer.content.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    *chunks, relayed_error = [json.loads(e) for e in events[:-1]]
    assert [set(c) for c in chunks] == [{"id", "object", "created", "model", "choices", "system_fingerprint"}] * 3 + [
        {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    ]
    assert {c["system_fingerprint"] for c in chunks} == {None}
    assert {c["model"] for c in chunks} == {"support-bot"}
    assert chunks[1]["choices"] == [{"index": 0, "delta": {"content": "Hel"}}]
    assert chunks[2]["choices"] == [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]
    assert chunks[3]["usage"] == usage["usage"]
    # Not an answer object: an error event is relayed as it was, but for the model's name.
    assert relayed_error == {"error": error["error"] | {"message": "support-bot ran out of memory"}}


def test_a_completion_stream_drops_token_ids_and_stop_reason(world):
    base = {"id": "cmpl-abc", "object": "text_completion", "created": 1, "model": "LORA"}
    chunk = base | {
        "choices": [
            {
                "index": 0,
                "text": "Hi",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": "END",
                "prompt_token_ids": [1],
                "token_ids": [9],
            }
        ]
    }
    _answering(world, _events(chunk, "[DONE]"))

    answer = send(world, COMPLETIONS, stream=True)

    [relayed] = [json.loads(e.removeprefix("data: ")) for e in answer.content.decode().split("\n\n")[:1]]
    assert relayed["choices"] == [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "stop"}]
    assert relayed["system_fingerprint"] is None


# ---------------------------------------------------------------------------------------------
# Over a real socket: the node gets the body as sent, and none of the client's headers


def test_the_node_gets_the_body_as_sent_and_none_of_the_clients_headers(world):
    completion = {k: v for k, v in VLLM_COMPLETION.items() if k != "kv_transfer_params"} | {"model": "x"}
    payload = json.dumps(completion).encode()

    async def node(reader, writer, server: Server) -> None:
        while await server.read_request(reader):
            head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
            writer.write(head.encode() + payload)
            await writer.drain()

    body = {"model": "support-bot", "prompt": "Hi", "max_tokens": 3, "seed": 5, "temperature": 1.0}
    headers = {
        "Authorization": f"Bearer {world.token}",
        "X-Request-Id": "fixed",
        "Cookie": "sessionid=abc",
        "X-Forwarded-For": "10.0.0.1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    state = gateway_state(Upstream(max_connections=4, connect_timeout=2.0, read_timeout=10.0, pool_timeout=2.0))

    async def scenario():
        async with Server(node) as server:
            await sync_to_async(ServingNode.objects.filter(id=world.node_a.id).update)(url=server.url)
            async with site(state) as client:
                response = await client.post(COMPLETIONS, json=body, headers=headers)
            await settle(state)
            return response, server.requests

    try:
        response, requests = async_to_sync(scenario)()
    finally:
        state.db.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["system_fingerprint"] is None
    [(line, sent_headers, sent_body)] = requests
    assert line == "POST /v1/completions HTTP/1.1"
    assert json.loads(sent_body) == body | {"model": world.lora}
    sent = {name.lower() for name in sent_headers}
    assert not sent & {"authorization", "x-request-id", "cookie", "x-forwarded-for", "traceparent"}
