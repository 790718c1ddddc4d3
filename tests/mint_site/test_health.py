from __future__ import annotations

from unittest import mock

import pytest
from django.db import OperationalError
from django.test import override_settings

from devtools.supervisor import free_port
from tests.conftest import error_of
from tests.factories import UserFactory
from tests.metrics_scrape import METRICS_TOKEN, scrape_metrics

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_dependencies(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_is_ok_with_database_and_redis(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    assert response.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_readyz_turns_503_when_redis_is_unreachable(client, caplog):
    port = free_port()
    with override_settings(REDIS_URL=f"redis://127.0.0.1:{port}/0"):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "checks": {"database": "ok", "redis": "unavailable"}}
    # The reason goes to the log, never to the (public) probe's body.
    assert str(port) not in response.content.decode()
    logged = [record for record in caplog.records if record.name == "mint_site.health"]
    assert logged and logged[0].exc_info is not None and "Redis" in logged[0].getMessage()


def test_readyz_names_a_failed_database_without_its_error(client, caplog):
    def refuse(*args, **kwargs):
        raise OperationalError('connection to server at "db.internal" (10.0.0.7), port 5432 failed')

    with mock.patch("mint_site.health.connection.cursor", refuse):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "checks": {"database": "unavailable", "redis": "ok"}}
    assert b"db.internal" not in response.content and b"10.0.0.7" not in response.content
    logged = [record for record in caplog.records if record.name == "mint_site.health"]
    assert logged and "db.internal" in str(logged[0].exc_info[1])


def test_metrics_expose_request_counts(client):
    client.get("/healthz")
    assert 'mint_http_requests_total{method="GET",route="healthz",status="200"}' in scrape_metrics(client)


def test_metrics_refuse_anonymous_callers(client, settings):
    settings.MINT_METRICS_TOKEN = METRICS_TOKEN
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert error_of(response)["code"] == "not_authenticated"
    assert b"mint_http_requests_total" not in response.content


def test_metrics_refuse_a_wrong_token(client, settings):
    settings.MINT_METRICS_TOKEN = METRICS_TOKEN
    for token in (METRICS_TOKEN[:-1] + "x", METRICS_TOKEN + "x", ""):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert response.status_code == 401, token
        assert response["WWW-Authenticate"].startswith("Bearer")


def test_metrics_with_no_token_configured_refuse_every_bearer(client, settings):
    settings.MINT_METRICS_TOKEN = ""
    for header in ("Bearer ", "Bearer  ", "Bearer x"):
        assert client.get("/metrics", HTTP_AUTHORIZATION=header).status_code == 401, header


def test_metrics_refuse_signed_in_people_who_are_not_staff(client, settings):
    settings.MINT_METRICS_TOKEN = METRICS_TOKEN
    client.force_login(UserFactory(username="metrics-nonstaff"))
    response = client.get("/metrics")
    assert response.status_code == 403
    assert error_of(response)["code"] == "permission_denied"


def test_metrics_answer_a_staff_session_even_with_no_token_configured(client, settings):
    settings.MINT_METRICS_TOKEN = ""
    client.force_login(UserFactory(username="metrics-staff", is_staff=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "mint_http_requests_total" in response.content.decode()


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
