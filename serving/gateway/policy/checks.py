"""Checks of one request field's value, which serving/gateway/policy/fields.py puts together per endpoint.

A check takes the field's name as error messages say it (`messages[2].content`), its value (never None:
a null asks for the engine's default and is forwarded as sent) and the tenant's plan; it raises a 400
`GatewayError` naming the field, or returns. Types are strict: a boolean is no integer and a string no
number, so a tenant learns about a slip here rather than from whatever the engine makes of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from serving.gateway import GatewayError

if TYPE_CHECKING:
    from serving.gateway.auth import GatewayPlan

Check = Callable[[str, Any, "GatewayPlan"], None]


def invalid(name: str, expected: str) -> GatewayError:
    return GatewayError(400, "invalid_parameter", f"`{name}` must be {expected}.")


def shown(name: str) -> str:
    """A tenant's key as a message quotes it: a key may be as long as the body."""
    return name if len(name) <= 100 else name[:100] + "…"


def is_int(value: Any) -> bool:
    return type(value) is int  # not a bool, which Python counts as an int


def is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


def is_number(value: Any) -> bool:
    # json.loads reads NaN and Infinity; neither is a setting.
    return type(value) is int or (type(value) is float and math.isfinite(value))


def anything(name: str, value: Any, plan: GatewayPlan) -> None:
    """Checked elsewhere: `model` by parse_model, a part's `type` by `_text_part`."""


def number(name: str, value: Any, plan: GatewayPlan) -> None:
    if not is_number(value):
        raise invalid(name, "a number")


def integer(name: str, value: Any, plan: GatewayPlan) -> None:
    if not is_int(value):
        raise invalid(name, "an integer")


def count(name: str, value: Any, plan: GatewayPlan) -> None:
    if not is_token_id(value):
        raise invalid(name, "an integer ≥ 0")


def boolean(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not bool:
        raise invalid(name, "true or false")


def string(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not str:
        raise invalid(name, "a string")


def json_object(name: str, value: Any, plan: GatewayPlan) -> None:
    """A JSON schema or the like: the engine reads it, the gateway only measures it."""
    if type(value) is not dict:
        raise invalid(name, "an object")


def token_ids(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not list or not all(is_token_id(t) for t in value):
        raise invalid(name, "a list of token ids (integers ≥ 0)")


def strings(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not list or not all(type(s) is str for s in value):
        raise invalid(name, "a list of strings")


def stop(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not str:
        strings(name, value, plan)


def logit_bias(name: str, value: Any, plan: GatewayPlan) -> None:
    if type(value) is not dict or not all(is_number(bias) for bias in value.values()):
        raise invalid(name, "an object mapping token ids to numbers")


def one_of(*choices: str) -> Check:
    def check(name: str, value: Any, plan: GatewayPlan) -> None:
        if type(value) is not str or value not in choices:
            raise invalid(name, "one of " + ", ".join(repr(c) for c in choices))

    return check


def json_fields(fields: Mapping[str, Check], *, required: tuple[str, ...] = ()) -> Check:
    """A JSON object whose keys are among `fields` (any other is refused by name), each checked by its own."""

    def check(name: str, value: Any, plan: GatewayPlan) -> None:
        if type(value) is not dict:
            raise invalid(name, "an object")
        for key, item in value.items():
            inner = fields.get(key)
            if inner is None:
                raise GatewayError(400, "unsupported_parameter", f"`{name}.{shown(key)}` is not accepted.")
            if item is not None:
                inner(f"{name}.{key}", item, plan)
        for key in required:
            if value.get(key) is None:
                raise invalid(f"{name}.{key}", "given")

    return check


def list_of(item: Check, what: str) -> Check:
    def check(name: str, value: Any, plan: GatewayPlan) -> None:
        if type(value) is not list or not value:
            raise invalid(name, f"a non-empty list of {what}")
        for i, element in enumerate(value):
            item(f"{name}[{i}]", element, plan)

    return check


def at_most(plan_field: str, code: str, *, minimum: int = 0) -> Check:
    """An integer from `minimum` to the tenant's plan field. vLLM reads -1 as "every token": never allowed."""

    def check(name: str, value: Any, plan: GatewayPlan) -> None:
        if not is_int(value) or value < minimum:
            raise invalid(name, f"an integer ≥ {minimum}")
        limit = getattr(plan, plan_field)
        if value > limit:
            raise GatewayError(
                400, code, f"`{name}` is {value}; this tenant's plan allows at most {limit} ({plan_field})."
            )

    return check


max_tokens = at_most("max_request_tokens", "max_tokens_too_large")
choices = at_most("max_choices", "too_many_choices", minimum=1)
logprobs = at_most("max_logprobs", "too_many_logprobs")
