"""`model` strings: `<adapter>`, `<adapter>:<alias>`, `<adapter>@r<n>`."""

from __future__ import annotations

import pytest

from serving.gateway import GatewayError
from serving.gateway.resolve import ModelRef, parse_model


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("support-bot", ModelRef("support-bot", None, None)),
        ("support-bot:candidate", ModelRef("support-bot", "candidate", None)),
        ("support-bot:production", ModelRef("support-bot", "production", None)),
        ("support-bot@r12", ModelRef("support-bot", None, 12)),
        ("bot.v2_x-1@r1", ModelRef("bot.v2_x-1", None, 1)),
        ("0bot", ModelRef("0bot", None, None)),
        ("a" * 64, ModelRef("a" * 64, None, None)),
    ],
)
def test_parse_model_accepts_the_three_forms(value, expected):
    assert parse_model(value) == expected


def test_bare_adapter_means_the_production_alias_and_a_pin_means_no_alias():
    assert parse_model("bot").alias_name == "production"
    assert parse_model("bot:candidate").alias_name == "candidate"
    assert parse_model("bot@r3").alias_name is None


@pytest.mark.parametrize(
    "value",
    [
        "Bot",
        " bot",
        "bot ",
        "bot:",
        "bot@",
        "bot@r",
        "bot@r0",
        "bot@r01",
        "bot@12",
        "bot@rx",
        "bot:a:b",
        "bot:prod@r1",
        "bot@r1:prod",
        "bot:Prod",
        "bot:1prod",
        "-bot",
        "a" * 65,
        "t1-a2-r3/../x",
        "bot@r12345678901",
    ],
)
def test_parse_model_refuses_malformed_strings_with_a_400(value):
    with pytest.raises(GatewayError) as refused:
        parse_model(value)
    assert refused.value.status == 400
    assert refused.value.code == "invalid_model"
    assert "<adapter>@r<n>" in refused.value.message
    assert refused.value.body() == {
        "error": {"code": "invalid_model", "message": refused.value.message, "type": "invalid_request_error"}
    }


@pytest.mark.parametrize("value", [None, "", 5, ["bot"], {"adapter": "bot"}])
def test_parse_model_refuses_a_missing_or_non_string_model(value):
    with pytest.raises(GatewayError) as refused:
        parse_model(value)
    assert refused.value.status == 400
    assert refused.value.code == "missing_model"
    assert "`model`" in refused.value.message
