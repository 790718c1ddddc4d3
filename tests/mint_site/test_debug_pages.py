"""`make run` runs with DEBUG=1: Django's debug pages (the site's URL patterns, tracebacks) go to staff only."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient, Client
from django.urls import path

from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def _boom(request):
    raise RuntimeError("secret local state")


urlpatterns = [path("boom/", _boom)]


@pytest.fixture
def debug(settings):
    settings.DEBUG = True
    return settings


def test_anonymous_gets_the_plain_404_under_debug(debug):
    response = Client().get("/no-such-page/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert b"URLconf" not in response.content and b"api/v1/" not in response.content


def test_anonymous_gets_the_plain_404_on_the_async_path(debug):
    response = async_to_sync(AsyncClient().get)("/no-such-page/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert b"URLconf" not in response.content


def test_a_views_404_is_plain_for_a_signed_in_member(debug, tenant_a):
    client = Client()
    client.force_login(tenant_a.users["owner"])
    response = client.get("/adapters/no-such-adapter/")
    assert response.status_code == 404
    assert b"Raised by" not in response.content and b"Traceback" not in response.content


def test_staff_still_get_the_debug_404(debug):
    client = Client()
    client.force_login(UserFactory(is_staff=True))
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert b"URLconf" in response.content


def test_a_views_exception_is_a_plain_500_for_anonymous_users(debug):
    debug.ROOT_URLCONF = __name__
    client = Client(raise_request_exception=False)
    response = client.get("/boom/")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "server_error"
    assert b"secret local state" not in response.content


def test_without_debug_nothing_changes(settings):
    settings.DEBUG = False
    response = Client().get("/no-such-page/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
