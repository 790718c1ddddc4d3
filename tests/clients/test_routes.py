"""Every route the SDK calls (mint_client.routes.ROUTES, its one registry) is in the server's OpenAPI schema."""

from __future__ import annotations

import re

import pytest
from drf_spectacular.generators import SchemaGenerator
from mint_client.routes import ROUTES

METHODS = ("get", "post", "put", "patch", "delete")


def _shape(path: str) -> str:
    """A path template with its parameters unnamed: the server may call `{number}` what the SDK calls `{n}`."""
    return re.sub(r"\{[^}]+\}", "{}", path)


@pytest.fixture(scope="module")
def operations() -> set[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {
        (method.upper(), _shape(path)) for path, ops in schema["paths"].items() for method in ops if method in METHODS
    }


def test_every_route_the_sdk_calls_is_in_the_openapi_schema(operations):
    missing = [
        f"{name}: {route.method} {route.path}"
        for name, route in ROUTES.items()
        if (route.method, _shape(route.path)) not in operations
    ]
    assert not missing, missing
    assert len(ROUTES) >= 30


def test_the_registry_fills_in_and_quotes_path_parameters():
    assert (
        ROUTES["revisions.approve"].url(name="support-bot", number=3)
        == "/api/v1/adapters/support-bot/revisions/3/approve/"
    )
    assert ROUTES["adapters.get"].url(name="a/b") == "/api/v1/adapters/a%2Fb/"
