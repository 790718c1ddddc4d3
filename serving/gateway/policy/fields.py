"""The fields a tenant may send to each endpoint, and `check_request`, which refuses anything else.

See the package's docstring for why an allow-list; docs/gateway.md, "Request fields", lists the same
for people. Each field has a check (checks.py); the plan bounds max_tokens, n and the log probabilities,
the number of choices a list of prompts asks for, and the bytes of structured-output constraints.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from serving.gateway import GatewayError
from serving.gateway.policy import checks
from serving.gateway.policy.checks import Check

if TYPE_CHECKING:
    from serving.gateway.auth import GatewayPlan

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def _prompt(name: str, value: Any, plan: GatewayPlan) -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists (counted in `_check_choices`)."""
    if type(value) is str:
        return
    if type(value) is list and value:
        if all(type(p) is str for p in value) or all(checks.is_token_id(t) for t in value):
            return
        if all(type(p) is list and p and all(checks.is_token_id(t) for t in p) for p in value):
            return
    raise checks.invalid(name, "a string, a list of strings, a list of token ids or a list of lists of token ids")


def _prompts(prompt: Any) -> int:
    """How many prompts (each a choice, times n) a checked `prompt` holds."""
    if type(prompt) is list and prompt and type(prompt[0]) in (str, list):
        return len(prompt)
    return 1


_text_fields = checks.json_fields({"type": checks.anything, "text": checks.string}, required=("text",))


def _text_part(name: str, value: Any, plan: GatewayPlan) -> None:
    """Text only: every other part (image_url, input_audio, video_url, file, …) has the node fetch or decode media."""
    kind = value.get("type") if type(value) is dict else None
    if kind != "text":
        shown = f"a {checks.shown(kind)!r} part" if type(kind) is str else "not a text part"
        raise GatewayError(
            400,
            "unsupported_parameter",
            f'`{name}` is {shown}: only text parts ({{"type": "text", "text": …}}) are accepted.',
        )
    _text_fields(name, value, plan)


_text_parts = checks.list_of(_text_part, "text parts")


def _content(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not str:
        _text_parts(name, value, plan)


_tool_call = checks.json_fields(
    {
        "id": checks.string,
        "type": checks.one_of("function"),
        "function": checks.json_fields({"name": checks.string, "arguments": checks.string}),
    }
)
_message = checks.json_fields(
    {
        "role": checks.one_of("system", "developer", "user", "assistant", "tool"),
        "content": _content,
        "name": checks.string,
        "tool_calls": checks.list_of(_tool_call, "tool calls"),
        "tool_call_id": checks.string,
    },
    required=("role",),
)
_messages = checks.list_of(_message, "messages")


# ---------------------------------------------------------------------------------------------
# Structured outputs and tools: a constraint is compiled into a grammar on the node, so it is bounded by
# the plan's max_structured_output_bytes (summed over the request) as well as checked in shape.

_response_format = checks.json_fields(
    {
        "type": checks.one_of("text", "json_object", "json_schema"),
        "json_schema": checks.json_fields(
            {
                "name": checks.string,
                "description": checks.string,
                "schema": checks.json_object,
                "strict": checks.boolean,
            }
        ),
    },
    required=("type",),
)


def _json_constraint(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) not in (str, dict):
        raise checks.invalid(name, "a JSON schema (an object or a string)")


_structured_outputs = checks.json_fields(
    {
        "json": _json_constraint,
        "regex": checks.string,
        "choice": checks.strings,
        "grammar": checks.string,
        "json_object": checks.boolean,
        "disable_any_whitespace": checks.boolean,
        "disable_additional_properties": checks.boolean,
        "whitespace_pattern": checks.string,
    }
)
_tools = checks.list_of(
    checks.json_fields(
        {
            "type": checks.one_of("function"),
            "function": checks.json_fields(
                {
                    "name": checks.string,
                    "description": checks.string,
                    "parameters": checks.json_object,
                    "strict": checks.boolean,
                },
                required=("name",),
            ),
        },
        required=("function",),
    ),
    "tools",
)
_named_tool = checks.json_fields(
    {"type": checks.one_of("function"), "function": checks.json_fields({"name": checks.string}, required=("name",))}
)


_tool_mode = checks.one_of("none", "auto", "required")


def _tool_choice(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is str:
        _tool_mode(name, value, plan)
    else:
        _named_tool(name, value, plan)


_STRUCTURED = ("response_format", "structured_outputs", "tools")


def _constraints(body: dict[str, Any]) -> list[str]:
    """The request's fields that constrain decoding (a `response_format` of type text does not)."""
    found = []
    for name in _STRUCTURED:
        value = body.get(name)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            found.append(name)
    return found


def _check_structured(body: dict[str, Any], plan: GatewayPlan) -> None:
    names = _constraints(body)
    if not names:
        return
    limit = plan.max_structured_output_bytes
    listed = ", ".join(f"`{n}`" for n in names)
    if limit == 0:
        raise GatewayError(
            400,
            "structured_output_not_allowed",
            f"{listed}: this tenant's plan allows no structured outputs (max_structured_output_bytes is 0).",
        )
    size = sum(len(json.dumps(body[n], ensure_ascii=False, separators=(",", ":")).encode()) for n in names)
    if size > limit:
        raise GatewayError(
            400,
            "structured_output_too_large",
            f"The structured-output constraints ({listed}) take {size} bytes; this tenant's plan allows at most "
            f"{limit} (max_structured_output_bytes).",
        )


# ---------------------------------------------------------------------------------------------
# The endpoints

_SAMPLING: dict[str, Check] = {
    "model": checks.anything,
    "max_tokens": checks.max_tokens,
    "n": checks.choices,
    "temperature": checks.number,
    "top_p": checks.number,
    "top_k": checks.integer,
    "min_p": checks.number,
    "seed": checks.integer,
    "stop": checks.stop,
    "stop_token_ids": checks.token_ids,
    "presence_penalty": checks.number,
    "frequency_penalty": checks.number,
    "repetition_penalty": checks.number,
    "ignore_eos": checks.boolean,
    "min_tokens": checks.count,
    "skip_special_tokens": checks.boolean,
    "spaces_between_special_tokens": checks.boolean,
    "include_stop_str_in_output": checks.boolean,
    "logit_bias": checks.logit_bias,
    "user": checks.string,
    "stream": checks.boolean,
    "stream_options": checks.json_fields({"include_usage": checks.boolean, "continuous_usage_stats": checks.boolean}),
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    # Routed experts (R3) for sampling keys (serving/gateway/sampling.py checks who may ask, and drops the first).
    "return_routed_experts": checks.boolean,
    "routed_experts_prompt_start": checks.count,
    # Log-probabilities' tokens as `token_id:<id>`: the sampled tokens' ids, which an RL trainer needs.
    "return_tokens_as_token_ids": checks.boolean,
}

FIELDS: dict[str, dict[str, Check]] = {
    COMPLETIONS: _SAMPLING
    | {
        "prompt": _prompt,
        "echo": checks.boolean,
        "suffix": checks.string,
        "logprobs": checks.logprobs,
        "best_of": checks.choices,
    },
    CHAT_COMPLETIONS: _SAMPLING
    | {
        "messages": _messages,
        "max_completion_tokens": checks.max_tokens,
        "logprobs": checks.boolean,
        "top_logprobs": checks.logprobs,
        "tools": _tools,
        "tool_choice": _tool_choice,
        "parallel_tool_calls": checks.boolean,
        "reasoning_effort": checks.one_of("none", "minimal", "low", "medium", "high", "xhigh", "max"),
        "add_generation_prompt": checks.boolean,
        "continue_final_message": checks.boolean,
    },
}

# Why a field is refused, where a tenant might expect it to work.
_ENGINE_ONLY = frozenset(
    {
        "priority",
        "request_id",
        "session_id",
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "cache_salt",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "documents",
        "prompt_embeds",
    }
)
_REMOVED_GUIDED = frozenset(
    {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend"}
)


def _unsupported(name: str, path: str) -> GatewayError:
    other = CHAT_COMPLETIONS if path == COMPLETIONS else COMPLETIONS
    if name in _ENGINE_ONLY:
        why = "it is a setting of the serving engine, not of a request"
    elif name in _REMOVED_GUIDED:
        why = "the serving engine (vLLM 0.32) ignores guided_* fields; send `structured_outputs` or `response_format`"
    elif name in FIELDS[other]:
        why = f"it belongs to {other}"
    else:
        why = "the gateway forwards only the fields its documentation lists (Gateway request fields)"
    return GatewayError(400, "unsupported_parameter", f"`{checks.shown(name)}` is not accepted on {path}: {why}.")


def _check_choices(path: str, body: dict[str, Any], plan: GatewayPlan) -> None:
    """Each prompt of a list is answered n times: the choices of the whole request are bounded, not just n."""
    if path != COMPLETIONS:
        return
    n = body.get("n") or 1
    prompts = _prompts(body.get("prompt"))
    if prompts > 1 and prompts * n > plan.max_choices:
        raise GatewayError(
            400,
            "too_many_choices",
            f"`prompt` holds {prompts} prompts and `n` is {n}: {prompts * n} choices; this tenant's plan "
            f"allows at most {plan.max_choices} (max_choices).",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        # vLLM 0.32 has no best_of: forwarded, it would be ignored.
        raise GatewayError(
            400,
            "unsupported_parameter",
            f"`best_of` is {best_of} and `n` is {n}: the serving engine does not rank candidates, so "
            "`best_of` may only equal `n`.",
        )


def check_request(path: str, body: dict[str, Any], plan: GatewayPlan) -> None:
    """Refuse, with a 400 naming the field, a body the gateway must not forward for `plan`'s tenant.

    Fields are checked in the order sent, and the first refusal is the answer; the body is not changed.
    """
    fields = FIELDS[path]
    for name, value in body.items():
        check = fields.get(name)
        if check is None:
            raise _unsupported(name, path)
        if value is not None:
            check(name, value, plan)
    _check_choices(path, body, plan)
    _check_structured(body, plan)


# The engine's own bound of a completion that names none (vLLM's OpenAI server).
COMPLETION_DEFAULT_TOKENS = 16
# The gateway has no tokenizer: a prompt is estimated at one token per this many bytes of the request's body
# (English text runs about four bytes a token; the estimate is settled against the node's count afterwards).
BODY_BYTES_PER_TOKEN = 4


def tokens_at_most(path: str, body: dict[str, Any], plan: GatewayPlan, *, body_bytes: int) -> int:
    """What a checked request may cost: its token bound times `n` for each prompt, plus its prompt estimated from
    the body's size. The token limits reserve it when the request is admitted (serving/gateway/budgets.py)."""
    bounds = [body.get(name) for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]
    if bounds:
        bound = max(bounds)
    else:
        bound = plan.max_request_tokens if path == CHAT_COMPLETIONS else COMPLETION_DEFAULT_TOKENS
    choices = (body.get("n") or 1) * (_prompts(body.get("prompt")) if path == COMPLETIONS else 1)
    return bound * choices + math.ceil(body_bytes / BODY_BYTES_PER_TOKEN)


def with_plan_defaults(
    path: str, body: dict[str, Any], plan: GatewayPlan, *, max_model_len: int | None = None
) -> dict[str, Any]:
    """The checked body as the node gets it: a chat request that bounds no tokens is bounded by the plan, and by
    the node's context window (`max_model_len`, when the nodes serving it reported theirs).

    Left to the engine, a chat completion without `max_tokens` or `max_completion_tokens` runs to the end of
    the node's context window; a completion's default is 16 tokens, which needs no bound. The engine refuses a
    bound over its context window but takes one up to it, and then stops at the window less the prompt: so the
    default is min(plan, max_model_len), and the request's own default never gets it refused.
    """
    if path == CHAT_COMPLETIONS and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        bound = plan.max_request_tokens if not max_model_len else min(plan.max_request_tokens, max_model_len)
        return body | {"max_completion_tokens": bound}
    return body
