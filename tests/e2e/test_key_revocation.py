"""Revocations and rights changes reach every gateway process within a second, not at the end of its key cache.

Two real uvicorn processes serve the site against the test database, each with a key cache of 300 s
(MINT_GATEWAY_KEY_CACHE_S), so only the `api_key.changed` event each follows can explain a refusal
within the test's time. Both are warmed with the key (GET /v1/models), the key's rights are changed,
and both are polled until they refuse it; the latency of each is printed.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings
from django.test import Client

from adapters.models import Adapter, AdapterRevision, BaseModel
from devtools.supervisor import wait_for
from tenants import services
from tenants.access import Actor
from tenants.models import Role
from tests.e2e.conftest import platform_followers

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

KEY_CACHE_S = "300"
HANG_S = 10.0  # how long one request, and the whole wait for a refusal, may take
DEADLINE_S = 1.0  # what the design promises


@pytest.fixture
def gateways(start_web) -> list[str]:
    """Two web processes (each with its gateway), both following live events."""
    before = platform_followers()
    urls = [start_web({"MINT_GATEWAY_KEY_CACHE_S": KEY_CACHE_S}) for _ in range(2)]
    wait_for(lambda: platform_followers() >= before + 2, timeout=30, what="both gateways' event feeds")
    return urls


def _models(base: str, token: str) -> httpx.Response:
    return httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=HANG_S)


def _warm(urls: list[str], token: str) -> None:
    for base in urls:
        assert _models(base, token).status_code == 200  # now cached in that process for 300 s


def _first_refusal(base: str, token: str, since: float) -> tuple[float, dict]:
    """Poll until `base` refuses the key with 401: (seconds since `since`, its error)."""
    with httpx.Client(timeout=HANG_S) as client:
        while time.monotonic() - since < HANG_S:
            response = client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {token}"})
            if response.status_code == 401:
                return time.monotonic() - since, response.json()["error"]
            assert response.status_code == 200, response.text
            time.sleep(0.005)
    raise AssertionError(f"{base} still accepted the key after {HANG_S:.0f} s")


def _refusals(urls: list[str], token: str, since: float) -> list[tuple[float, dict]]:
    with ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(lambda base: _first_refusal(base, token, since), urls))


def _owner_session(user) -> httpx.Client:
    """An HTTP client signed in as `user` (a session in the test database) with a CSRF token to send back."""
    django_client = Client()
    django_client.force_login(user)
    csrf = secrets.token_hex(16)  # a 32-character secret, as Django's cookie holds
    return httpx.Client(
        cookies={
            settings.SESSION_COOKIE_NAME: django_client.cookies[settings.SESSION_COOKIE_NAME].value,
            settings.CSRF_COOKIE_NAME: csrf,
        },
        headers={"X-CSRFToken": csrf},
        timeout=HANG_S,
    )


def _report(what: str, latencies: list[float]) -> None:
    print(f"\n{what}: refused by the two gateway processes after " + ", ".join(f"{s * 1000:.0f} ms" for s in latencies))


def test_a_key_revoked_through_the_api_is_refused_by_every_gateway_within_a_second(gateways, tenant_a):
    key, token = tenant_a.key("inference")
    _warm(gateways, token)

    with _owner_session(tenant_a.users[Role.OWNER]) as owner:
        started = time.monotonic()
        revoked = owner.delete(f"{gateways[0]}/api/v1/keys/{key.prefix}/")
        answered = time.monotonic() - started
    assert revoked.status_code == 204, revoked.text

    refusals = _refusals(gateways, token, started)
    _report(f"revocation (DELETE answered in {answered * 1000:.0f} ms)", [s for s, _ in refusals])
    assert {error["code"] for _, error in refusals} == {"api_key_revoked"}
    assert all(latency < DEADLINE_S for latency, _ in refusals)


def test_a_removed_members_key_is_refused_by_every_gateway_within_a_second(gateways, tenant_a):
    developer = tenant_a.users[Role.DEVELOPER]
    key, token = services.api_key_create(
        tenant=tenant_a.tenant, name="dev", scopes=["inference"], created_by=developer, by=Actor(user=developer)
    )
    _warm(gateways, token)

    started = time.monotonic()
    services.membership_remove(tenant=tenant_a.tenant, user=developer, by=Actor(user=tenant_a.users[Role.OWNER]))

    refusals = _refusals(gateways, token, started)
    _report("member removed", [s for s, _ in refusals])
    assert {error["code"] for _, error in refusals} == {"api_key_owner_inactive"}
    assert all(f"mint_{key.prefix}_" in error["message"] for _, error in refusals)
    assert all(latency < DEADLINE_S for latency, _ in refusals)


def test_a_demoted_approvers_deploy_key_can_no_longer_approve_on_any_process(gateways, tenant_a):
    approver = tenant_a.users[Role.APPROVER]
    _, token = services.api_key_create(
        tenant=tenant_a.tenant, name="ci", scopes=["deploy", "inference"], created_by=approver, by=Actor(user=approver)
    )
    base_model = BaseModel.objects.create(name="e2e-base", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="bot", base_model=base_model)
    AdapterRevision.objects.create(
        adapter=adapter, number=1, state="pending_approval", source_uri="x", created_by=tenant_a.users[Role.DEVELOPER]
    )
    _warm(gateways, token)

    services.membership_set(tenant=tenant_a.tenant, user=approver, role=Role.DEVELOPER, by=Actor.system())

    headers = {"Authorization": f"Bearer {token}"}
    for base in gateways:
        refused = httpx.post(
            f"{base}/api/v1/adapters/bot/revisions/1/approve/", json={}, headers=headers, timeout=HANG_S
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        assert "no longer allows" in refused.json()["error"]["message"]
        # Inference stays open to a key of any member: the narrowed key still serves.
        assert _models(base, token).status_code == 200
    assert AdapterRevision.objects.get(adapter=adapter, number=1).state == "pending_approval"
