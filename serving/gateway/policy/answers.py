"""Answers in OpenAI's schema: what a completion, chat completion or chunk from vLLM keeps on its way back."""

from __future__ import annotations

from typing import Any, NamedTuple


class _Shape(NamedTuple):
    """The OpenAI fields of one kind of answer object, of its choices, and of a choice's message or delta."""

    fields: frozenset[str]
    choice: frozenset[str]
    inner: str | None = None
    inner_fields: frozenset[str] = frozenset()


_COMPLETION_FIELDS = frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint"})
_CHAT_FIELDS = _COMPLETION_FIELDS | {"service_tier"}
_DELTA_FIELDS = frozenset({"role", "content", "refusal", "function_call", "tool_calls"})
_SHAPES = {
    "text_completion": _Shape(_COMPLETION_FIELDS, frozenset({"index", "text", "logprobs", "finish_reason"})),
    "chat.completion": _Shape(
        _CHAT_FIELDS,
        frozenset({"index", "message", "logprobs", "finish_reason"}),
        "message",
        _DELTA_FIELDS | {"annotations", "audio"},
    ),
    "chat.completion.chunk": _Shape(
        _CHAT_FIELDS, frozenset({"index", "delta", "logprobs", "finish_reason"}), "delta", _DELTA_FIELDS
    ),
}
_USAGE_FIELDS = frozenset(
    {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"}
)
_USAGE_DETAILS = {
    "prompt_tokens_details": frozenset({"cached_tokens", "audio_tokens"}),
    "completion_tokens_details": frozenset(
        {"reasoning_tokens", "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"}
    ),
}


def _keep_only(data: dict[str, Any], fields: frozenset[str]) -> None:
    """Drop, in place, the keys not in `fields`: a dict without any (most stream chunks) costs one set test."""
    if not fields.issuperset(data):
        for key in data.keys() - fields:
            del data[key]


def _choice(choice: dict[str, Any], shape: _Shape, keep: frozenset[str]) -> None:
    _keep_only(choice, shape.choice | keep if keep else shape.choice)
    inner = choice.get(shape.inner) if shape.inner else None
    if type(inner) is dict:
        _keep_only(inner, shape.inner_fields)


def _usage(usage: dict[str, Any]) -> None:
    _keep_only(usage, _USAGE_FIELDS)
    for name in _USAGE_DETAILS.keys() & usage.keys():
        if type(usage[name]) is dict:
            _keep_only(usage[name], _USAGE_DETAILS[name])


def openai_answer(data: dict[str, Any], *, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A completion, chat completion or chunk with OpenAI's fields only (and a choice's fields in `keep`: the
    routed experts a sampling request asked for, serving/gateway/sampling.py); any other object (an error) as it is.

    vLLM adds `prompt_logprobs`, `prompt_token_ids`, `token_ids`, `stop_reason`, `kv_transfer_params`,
    `metrics`, a message's `reasoning` … and its own `system_fingerprint`; the caller sees OpenAI's schema.
    `data` is the gateway's own parse of the node's answer: it is changed in place (logprobs and texts are
    never walked or copied), and serializing it stays the caller's one pass.
    """
    kind = data.get("object")
    shape = _SHAPES.get(kind) if type(kind) is str else None
    if shape is None:
        return data
    _keep_only(data, shape.fields)
    data["system_fingerprint"] = None
    choices = data.get("choices")
    if type(choices) is list:
        for choice in choices:
            if type(choice) is dict:
                _choice(choice, shape, keep)
    if type(data.get("usage")) is dict:
        _usage(data["usage"])
    return data
