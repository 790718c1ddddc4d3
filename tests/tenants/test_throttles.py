"""Throttles of the REST API: per key or person at the tenant plan's rates, and failed authentications per address."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from rest_framework.test import APIClient

from tenants import services
from tenants.access import Actor
from tenants.auth import KeyRefused, TooManyAuthFailures, authenticate_token
from tenants.models import Tenant
from tenants.throttles import ApiRateThrottle, api_write_wait, client_bucket, plan_rate
from tests.conftest import error_of
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def plan(world, **rates: int) -> None:
    Tenant.objects.filter(id=world.tenant.id).update(**rates)


def bearer(token: str, address: str = "127.0.0.1") -> APIClient:
    client = APIClient(REMOTE_ADDR=address)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def new_adapter(client: APIClient, name: str):
    return client.post("/api/v1/adapters/", {"name": name, "base_model": "test-dense"}, format="json")


def assert_rate_limited(response, *, limit: int, kind: str) -> dict:
    assert response.status_code == 429, response.content
    error = error_of(response)
    assert error["code"] == "rate_limited"
    assert f"limit of {limit} API {kind} per minute" in error["message"]
    assert 1 <= int(response["Retry-After"]) <= 60
    assert f"retry in {response['Retry-After']} s" in error["message"]
    return error


# ---------------------------------------------------------------------------------------------
# Per key and per person, reads and writes apart


def test_a_key_is_limited_to_its_tenants_read_rate(tenant_a):
    plan(tenant_a, api_read_rpm=3)
    key, token = tenant_a.key("pipeline")
    client = bearer(token)
    for _ in range(3):
        assert client.get("/api/v1/").status_code == 200
    error = assert_rate_limited(client.get("/api/v1/"), limit=3, kind="reads")
    assert error["message"].startswith(f"Key mint_{key.prefix}… is over its tenant's limit")
    assert client.head("/api/v1/").status_code == 429  # HEAD is a read


def test_writes_are_counted_apart_from_reads(tenant_a, dense_base):
    plan(tenant_a, api_read_rpm=100, api_write_rpm=2)
    client = tenant_a.client_as("key:pipeline")
    assert new_adapter(client, "one").status_code == 201
    assert new_adapter(client, "two").status_code == 201
    assert_rate_limited(new_adapter(client, "three"), limit=2, kind="writes")
    assert client.get("/api/v1/adapters/").status_code == 200  # reads still go through
    assert not tenant_a.tenant.adapters.filter(name="three").exists()


def test_each_key_and_each_person_has_its_own_count(tenant_a):
    plan(tenant_a, api_read_rpm=2)
    first, second = tenant_a.client_as("key:pipeline"), tenant_a.client_as("key:deploy")
    viewer, developer = tenant_a.client_as("viewer"), tenant_a.client_as("developer")
    for client in (first, viewer):
        for _ in range(2):
            assert client.get("/api/v1/").status_code == 200
        assert client.get("/api/v1/").status_code == 429
    assert second.get("/api/v1/").status_code == 200
    assert developer.get("/api/v1/").status_code == 200


def test_a_person_is_told_whose_limit_they_hit(tenant_a):
    plan(tenant_a, api_read_rpm=1)
    viewer = tenant_a.client_as("viewer")
    viewer.get("/api/v1/")
    error = assert_rate_limited(viewer.get("/api/v1/"), limit=1, kind="reads")
    assert error["message"].startswith("acme-viewer is over tenant acme's limit of 1 API reads per minute per person")


def test_the_rate_is_read_from_the_plan_on_each_request(tenant_a):
    plan(tenant_a, api_read_rpm=1)
    client = tenant_a.client_as("key:pipeline")
    client.get("/api/v1/")
    assert client.get("/api/v1/").status_code == 429
    plan(tenant_a, api_read_rpm=5)  # raised: the same minute's history now fits
    assert client.get("/api/v1/").status_code == 200


def test_a_person_in_two_tenants_is_counted_in_each_apart(tenant_a, tenant_b):
    from tenants.models import Membership, Role

    person = tenant_a.users["viewer"]
    Membership.objects.create(user=person, tenant=tenant_b.tenant, role=Role.VIEWER)
    plan(tenant_a, api_read_rpm=1)
    client = tenant_a.client_as("viewer")
    assert client.get("/api/v1/", HTTP_X_MINT_TENANT="acme").status_code == 200
    assert client.get("/api/v1/", HTTP_X_MINT_TENANT="acme").status_code == 429
    assert client.get("/api/v1/", HTTP_X_MINT_TENANT="globex").status_code == 200


def test_base_models_are_throttled_like_every_tenant_view(tenant_a, dense_base):
    plan(tenant_a, api_read_rpm=1)
    client = tenant_a.client_as("key:pipeline")
    assert client.get("/api/v1/base-models/").status_code == 200
    assert_rate_limited(client.get("/api/v1/base-models/"), limit=1, kind="reads")


def test_staff_endpoints_are_throttled_per_person_at_the_plans_default_rates(db):
    assert (plan_rate(None, write=False), plan_rate(None, write=True)) == (
        Tenant._meta.get_field("api_read_rpm").default,
        Tenant._meta.get_field("api_write_rpm").default,
    )
    staff = UserFactory(username="ops", is_staff=True)
    client = APIClient()
    client.force_login(staff)
    with mock.patch("tenants.throttles.plan_rate", return_value=2):
        assert client.get("/api/v1/nodes/").status_code == 200
        assert client.get("/api/v1/nodes/").status_code == 200
        response = client.get("/api/v1/nodes/")
    assert response.status_code == 429
    assert error_of(response)["message"].startswith("ops is over the limit of 2 API reads per minute")


def test_a_write_counted_outside_drf_shares_the_apis_count(tenant_a, dense_base):
    plan(tenant_a, api_write_rpm=2)
    key, _ = tenant_a.key("pipeline")
    client = tenant_a.client_as("key:pipeline")
    tenant = Tenant.objects.get(id=tenant_a.tenant.id)
    assert api_write_wait(tenant=tenant, key=key, user=key.created_by) is None
    assert new_adapter(client, "one").status_code == 201
    wait = api_write_wait(tenant=tenant, key=key, user=key.created_by)
    assert wait is not None and 58 <= wait <= 60
    assert new_adapter(client, "two").status_code == 429
    # A person's writes are theirs, not their keys'.
    person = tenant_a.users["owner"]
    assert api_write_wait(tenant=tenant, key=None, user=person) is None


# ---------------------------------------------------------------------------------------------
# Failed authentications per client address


@pytest.fixture
def three_failures(settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 3


def test_a_guess_past_the_failure_limit_gets_429_and_a_valid_key_from_that_address_is_served(tenant_a, three_failures):
    _, token = tenant_a.key("pipeline")
    for guess in ("mint_nope_secret", "not-a-token", "mint_0123456789ab_wrong"):
        response = bearer(guess).get("/api/v1/")
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"

    response = bearer("mint_another_guess").get("/api/v1/")

    assert response.status_code == 429
    error = error_of(response)
    assert error["code"] == "too_many_auth_failures"
    assert 1 <= int(response["Retry-After"]) <= 60
    assert f"retry in {response['Retry-After']} s" in error["message"]
    # A valid key is checked first: the address's failures never refuse it (a NAT, a load balancer).
    assert bearer(token).get("/api/v1/").status_code == 200
    assert bearer("mint_nope_secret", address="10.1.2.3").get("/api/v1/").status_code == 401


def test_wrong_secrets_of_one_key_are_limited_per_key_from_any_address(tenant_a, three_failures):
    _, token = tenant_a.key("pipeline")
    prefix = token.split("_")[1]
    for i in range(3):
        assert bearer(f"mint_{prefix}_wrong{i}", address=f"198.51.100.{i}").get("/api/v1/").status_code == 401
    refused = bearer(f"mint_{prefix}_wrong9", address="198.51.100.9").get("/api/v1/")
    assert refused.status_code == 429 and error_of(refused)["code"] == "too_many_auth_failures"
    assert bearer(token, address="198.51.100.9").get("/api/v1/").status_code == 200


def test_an_idempotency_key_from_a_limited_address_claims_nothing_for_a_guess_and_serves_a_valid_key(
    tenant_a, three_failures, dense_base
):
    from tenants.models import IdempotencyRecord

    _, token = tenant_a.key("pipeline")
    for guess in ("mint_nope_secret", "not-a-token", "mint_x_wrong"):
        bearer(guess).get("/api/v1/")

    guessed = bearer("mint_another_guess").post(
        "/api/v1/adapters/", {"name": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert guessed.status_code == 429 and error_of(guessed)["code"] == "too_many_auth_failures"
    assert not IdempotencyRecord.objects.exists()
    created = bearer(token).post(
        "/api/v1/adapters/", {"name": "x", "base_model": "test-dense"}, format="json", HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert created.status_code == 201


@pytest.mark.django_db(transaction=True)
def test_a_flood_of_random_keys_never_refuses_a_valid_key_from_the_same_address(tenant_a, three_failures):
    """Both at once: four threads send random keys from one address while a valid key from it keeps calling."""
    import secrets
    import threading

    from django.db import connection

    _, token = tenant_a.key("pipeline")
    stop = threading.Event()
    flood: list[int] = []

    def guesser() -> None:
        try:
            while not stop.is_set():
                guess = f"mint_{secrets.token_hex(6)}_{secrets.token_urlsafe(16)}"
                flood.append(bearer(guess, address="203.0.113.50").get("/api/v1/").status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=guesser) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        while len(flood) < 10:
            stop.wait(0.01)
        valid = [bearer(token, address="203.0.113.50").get("/api/v1/").status_code for _ in range(15)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert valid == [200] * 15
    assert 429 in flood and set(flood) <= {401, 429}


def test_answers_about_genuine_keys_are_not_failures(tenant_a, three_failures):
    revoked, revoked_token = tenant_a.key("pipeline")
    services.api_key_revoke(key=revoked, by=Actor.system())
    for _ in range(5):
        assert error_of(bearer(revoked_token).get("/api/v1/"))["code"] == "api_key_revoked"
    assert bearer(tenant_a.key("deploy")[1]).get("/api/v1/").status_code == 200


def test_signed_in_people_are_not_counted(tenant_a, three_failures):
    client = tenant_a.client_as("viewer")
    for _ in range(5):
        assert client.get("/api/v1/").status_code == 200


def test_authenticate_token_counts_for_the_client_it_is_given(tenant_a, three_failures):
    _, token = tenant_a.key("pipeline")
    for _ in range(3):
        with pytest.raises(KeyRefused):
            authenticate_token("mint_nope_secret", client="192.0.2.7")
    with pytest.raises(TooManyAuthFailures) as refused:
        authenticate_token("mint_nope_secret", client="192.0.2.7")
    assert refused.value.status_code == 429 and 1 <= refused.value.wait <= 60
    assert refused.value.get_codes() == "too_many_auth_failures"
    assert authenticate_token(token, client="192.0.2.7").prefix == token.split("_")[1]  # never the valid key
    with pytest.raises(KeyRefused):
        authenticate_token("mint_nope_secret")  # no client: nothing is counted


def test_ipv6_addresses_are_counted_per_64(tenant_a, three_failures):
    assert client_bucket("2001:db8:1:2::5") == client_bucket("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert client_bucket("::ffff:192.0.2.1") == "192.0.2.1"
    assert client_bucket(None) is None
    for suffix in ("1", "2", "3"):
        bearer("mint_nope_secret", address=f"2001:db8:1:2::{suffix}").get("/api/v1/")
    assert bearer("mint_nope_secret", address="2001:db8:1:2::99").get("/api/v1/").status_code == 429
    assert bearer("mint_nope_secret", address="2001:db8:1:3::1").get("/api/v1/").status_code == 401


def test_without_redis_keys_are_still_checked(tenant_a, three_failures, settings, caplog):
    _, token = tenant_a.key("pipeline")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    for _ in range(5):
        with pytest.raises(KeyRefused):
            authenticate_token("mint_nope_secret", client="192.0.2.8")
    assert authenticate_token(token, client="192.0.2.8").prefix == token.split("_")[1]
    assert "Redis unavailable" in caplog.text


def test_retry_after_is_whole_seconds_rounded_up():
    refused = TooManyAuthFailures(wait=12.2)
    assert refused.wait == 13 == math.ceil(12.2)


def test_a_minutes_rate_cannot_be_spent_in_one_burst(tenant_a):
    plan(tenant_a, api_read_rpm=60)  # at most 10 in any 10 s
    client = tenant_a.client_as("key:pipeline")
    answers = [client.get("/api/v1/adapters/") for _ in range(11)]
    assert [a.status_code for a in answers[:10]] == [200] * 10
    refused = answers[10]
    assert refused.status_code == 429
    assert "at most 10 in any 10 s" in error_of(refused)["message"]
    assert 1 <= int(refused["Retry-After"]) <= 10


# ---------------------------------------------------------------------------------------------
# The tenant's writes, all its keys and people together


def test_more_keys_do_not_mean_more_writes(tenant_a, dense_base):
    plan(tenant_a, api_write_rpm=600, api_tenant_write_rpm=60)  # a burst of 10 for the tenant, 100 per key
    tokens = [
        tenant_a.key("pipeline", *extra)[1] for extra in ((), ("inference",), ("deploy",), ("inference", "deploy"))
    ]
    statuses = []
    for token in tokens * 3:
        statuses.append(bearer(token).post("/api/v1/adapters/", {}, format="json").status_code)  # 400: counted
    assert statuses[:10] == [400] * 10 and statuses[10:] == [429, 429]
    refused = bearer(tokens[0]).post("/api/v1/adapters/", {}, format="json")
    error = error_of(refused)
    assert error["code"] == "rate_limited" and "api_tenant_write_rpm" in error["message"]
    assert "Tenant acme is over its limit of 60 API writes per minute" in error["message"]
    assert bearer(tokens[0]).get("/api/v1/").status_code == 200  # reads are not the tenant's writes


def test_a_key_past_its_own_rate_does_not_use_up_its_tenants(tenant_a, dense_base):
    plan(tenant_a, api_write_rpm=2, api_tenant_write_rpm=60)
    _, greedy = tenant_a.key("pipeline")
    _, other = tenant_a.key("pipeline", "deploy")
    for _ in range(20):
        bearer(greedy).post("/api/v1/adapters/", {}, format="json")
    assert bearer(other).post("/api/v1/adapters/", {}, format="json").status_code == 400  # not 429
    tenant = Tenant.objects.get(id=tenant_a.tenant.id)
    wait = ApiRateThrottle().hit_tenant(tenant=tenant)
    assert wait is None  # the tenant counted 3 writes (2 of the greedy key, 1 of the other), not 21


def test_people_and_keys_share_the_tenants_write_rate(tenant_a, dense_base):
    plan(tenant_a, api_write_rpm=600, api_tenant_write_rpm=30)  # burst 5
    person = tenant_a.client_as("owner")
    _, token = tenant_a.key("pipeline")
    for _ in range(3):
        assert person.post("/api/v1/adapters/", {}, format="json").status_code == 400
    assert bearer(token).post("/api/v1/adapters/", {}, format="json").status_code == 400
    assert bearer(token).post("/api/v1/adapters/", {}, format="json").status_code == 400
    assert person.post("/api/v1/adapters/", {}, format="json").status_code == 429
