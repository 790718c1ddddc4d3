"""A key's own limits: the adapters it may call and its tokens per minute and per month, set when it is made,
checked and bounded there; the tenant's token plan fields beside them."""

from __future__ import annotations

from io import StringIO
from unittest import mock

import pytest
from django.core.management import CommandError, call_command

from tenants import services
from tenants.access import Actor
from tenants.models import ApiKey, AuditEvent, Role, Tenant
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

LIMITED = {
    "name": "support-frontend",
    "scopes": ["inference"],
    "adapters": ["triage", "support-bot", "support-bot"],
    "max_tokens_per_minute": 2000,
    "monthly_token_budget": 50000,
}


def create(client, **fields):
    return client.post("/api/v1/keys/", {"name": "k", "scopes": ["inference"], **fields}, format="json")


def test_an_owner_makes_a_key_with_limits_and_sees_them_in_the_list(tenant_a):
    owner = tenant_a.client_as("owner")

    created = owner.post("/api/v1/keys/", LIMITED, format="json")

    assert created.status_code == 201, created.content
    body = created.json()
    assert body["adapters"] == ["support-bot", "triage"]  # sorted, each once
    assert (body["max_tokens_per_minute"], body["monthly_token_budget"]) == (2000, 50000)
    (listed,) = owner.get("/api/v1/keys/").json()["results"]
    assert {k: listed[k] for k in ("adapters", "max_tokens_per_minute", "monthly_token_budget")} == {
        "adapters": ["support-bot", "triage"],
        "max_tokens_per_minute": 2000,
        "monthly_token_budget": 50000,
    }
    event = AuditEvent.objects.get(action="api_key.create")
    assert event.after["adapters"] == ["support-bot", "triage"] and event.after["monthly_token_budget"] == 50000


def test_a_key_without_limits_may_call_everything(tenant_a):
    created = create(tenant_a.client_as("owner")).json()
    assert (created["adapters"], created["max_tokens_per_minute"], created["monthly_token_budget"]) == ([], None, None)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"adapters": ["Support Bot"]}, "invalid_adapter_name", "adapters"),
        ({"adapters": ["a" * 65]}, "invalid_adapter_name", "adapters"),
        ({"adapters": ["-leading-dash"]}, "invalid_adapter_name", "adapters"),
        ({"adapters": "support-bot"}, "invalid_request", "adapters"),
        ({"adapters": [f"bot-{i}" for i in range(101)]}, "too_many_adapters", "adapters"),
        ({"max_tokens_per_minute": 0}, "invalid_request", "max_tokens_per_minute"),
        ({"monthly_token_budget": -5}, "invalid_request", "monthly_token_budget"),
        ({"monthly_token_budget": 2**64}, "invalid_request", "monthly_token_budget"),
        ({"max_tokens_per_minute": "lots"}, "invalid_request", "max_tokens_per_minute"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(tenant_a, fields, code, field):
    response = create(tenant_a.client_as("owner"), **fields)

    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["code"] == code
    assert field in error["message"]
    assert ApiKey.objects.count() == 0


def test_the_allow_list_bound_is_a_setting(tenant_a, settings):
    settings.MINT_KEY_MAX_ADAPTERS = 2
    owner = tenant_a.client_as("owner")
    assert create(owner, adapters=["a", "b"]).status_code == 201
    refused = create(owner, adapters=["a", "b", "c"])
    assert refused.status_code == 400 and error_of(refused)["detail"] == {"adapters": ["at most 2 names"]}


def test_a_key_cannot_be_given_more_tokens_than_its_tenant_has(tenant_a):
    Tenant.objects.filter(pk=tenant_a.tenant.pk).update(max_tokens_per_minute=1000, monthly_token_budget=10_000)
    owner = tenant_a.client_as("owner")

    refused = create(owner, max_tokens_per_minute=1001, monthly_token_budget=10_001)

    assert refused.status_code == 400
    detail = error_of(refused)["detail"]
    assert set(detail) == {"max_tokens_per_minute", "monthly_token_budget"}
    assert "1000" in detail["max_tokens_per_minute"][0] and "10000" in detail["monthly_token_budget"][0]
    assert create(owner, max_tokens_per_minute=1000, monthly_token_budget=10_000).status_code == 201
    assert create(owner, name="x", max_tokens_per_minute=5_000_000).status_code == 400
    # A tenant without a limit (0) leaves a key's own bounded only by what the field holds.
    Tenant.objects.filter(pk=tenant_a.tenant.pk).update(max_tokens_per_minute=0)
    assert create(owner, name="x", max_tokens_per_minute=5_000_000).status_code == 201


@pytest.mark.parametrize("principal", [Role.APPROVER, Role.DEVELOPER, Role.VIEWER, "outsider"])
def test_only_owners_make_keys_with_limits(tenant_a, principal):
    response = tenant_a.client_as(principal).post("/api/v1/keys/", LIMITED, format="json")

    assert response.status_code == 403
    assert ApiKey.objects.count() == 0


@pytest.mark.parametrize("scopes", ["inference", "deploy,inference,pipeline"])
def test_a_key_cannot_make_itself_a_key_with_other_limits(tenant_a, scopes):
    key, _ = tenant_a.key(*scopes.split(","))
    client = tenant_a.client_as(f"key:{scopes}")

    assert client.post("/api/v1/keys/", {**LIMITED, "adapters": []}, format="json").status_code == 403
    assert ApiKey.objects.exclude(id=key.id).count() == 0
    assert client.get("/api/v1/keys/").status_code == 403  # nor read what others may do


def test_another_tenants_owner_never_sees_a_keys_limits(tenant_a, tenant_b):
    assert tenant_a.client_as("owner").post("/api/v1/keys/", LIMITED, format="json").status_code == 201

    listed = tenant_b.client_as("owner").get("/api/v1/keys/").json()["results"]
    assert listed == []
    response = tenant_b.client_as("owner").get("/api/v1/keys/", HTTP_X_MINT_TENANT="acme")
    assert response.status_code == 404 and "support-frontend" not in response.content.decode()


def test_the_gateway_reauthenticates_keys_when_the_token_plan_changes(tenant_a):
    with mock.patch("tenants.services.live_event") as sent:
        services.tenant_update(
            tenant=tenant_a.tenant,
            changes={"monthly_token_budget": 1000, "max_tokens_per_minute": 50},
            by=Actor.system(),
        )
    assert [c.kwargs["type"] for c in sent.call_args_list] == [services.API_KEY_CHANGED]
    tenant_a.tenant.refresh_from_db()
    assert (tenant_a.tenant.monthly_token_budget, tenant_a.tenant.max_tokens_per_minute) == (1000, 50)


# ---------------------------------------------------------------------------------------------
# Commands


def run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_mint_key_create_takes_the_limits_and_list_shows_them(tenant_a):
    _, said = run(
        "mint_key",
        "create",
        "--tenant",
        "acme",
        "--scopes",
        "inference",
        "--adapters",
        "support-bot, triage",
        "--max-tokens-per-minute",
        "300",
        "--monthly-token-budget",
        "9000",
    )
    key = ApiKey.objects.get()
    assert (key.adapters, key.max_tokens_per_minute, key.monthly_token_budget) == (["support-bot", "triage"], 300, 9000)
    assert "adapters support-bot,triage" in said and "9000 tokens/month" in said

    listed, _ = run("mint_key", "list", "--tenant", "acme")
    assert listed.strip().split("\t")[-3:] == ["adapters support-bot,triage", "300 tokens/min", "9000 tokens/month"]


def test_mint_key_create_refuses_bad_limits(tenant_a):
    with pytest.raises(CommandError, match="adapter names"):
        run("mint_key", "create", "--tenant", "acme", "--scopes", "inference", "--adapters", "Bad Name")
    with pytest.raises(CommandError, match="monthly_token_budget"):
        run("mint_key", "create", "--tenant", "acme", "--scopes", "inference", "--monthly-token-budget", "0")
    assert ApiKey.objects.count() == 0


def test_mint_tenant_plan_sets_the_token_limits_audited(tenant_a):
    shown = dict(line.split("\t") for line in run("mint_tenant", "plan", "acme")[0].splitlines())
    assert (shown["max_tokens_per_minute"], shown["monthly_token_budget"]) == ("0", "0")

    run("mint_tenant", "plan", "acme", "--set", "max_tokens_per_minute=20000", "--set", "monthly_token_budget=10000000")

    tenant = Tenant.objects.get(slug="acme")
    assert (tenant.max_tokens_per_minute, tenant.monthly_token_budget) == (20000, 10_000_000)
    event = AuditEvent.objects.get(tenant=tenant, action="tenant.update")
    assert event.after == {"max_tokens_per_minute": 20000, "monthly_token_budget": 10_000_000}
    with pytest.raises(CommandError):
        run("mint_tenant", "plan", "acme", "--set", "monthly_token_budget=-1")
