from __future__ import annotations

import pytest
from django.test import override_settings

from mint_site.launcher import free_port

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_dependencies(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_is_ok_with_database_and_redis(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    assert response.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_readyz_turns_503_when_redis_is_unreachable(client):
    with override_settings(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"):
        response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert "ConnectionError" in body["checks"]["redis"]


def test_metrics_expose_request_counts(client):
    client.get("/healthz")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert 'mint_http_requests_total{method="GET",route="healthz",status="200"}' in response.content.decode()


def test_openapi_schema_and_docs_render(client):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/keys/" in schema.content
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


def test_unknown_api_route_is_a_json_404(client):
    response = client.get("/api/v1/no-such-thing/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_static_files_are_served(client):
    response = client.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert response.status_code == 200
    assert b"".join(response.streaming_content)[:100]


def test_async_requests_stay_on_the_event_loop():
    """No synchronous-only middleware: the async gateway must not be pushed into a thread per request."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    for path in settings.MIDDLEWARE:
        middleware = import_string(path)
        assert getattr(middleware, "async_capable", False), f"{path} is sync-only"
