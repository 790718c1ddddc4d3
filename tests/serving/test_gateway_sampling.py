"""Sampling before approval at the gateway (serving/gateway/sampling.py): a pipeline or sampling key calls any
exported revision of its tenant by number; inference keys, aliases and canaries see approved revisions only; a
revision that exists but this key may not call is 403 with a code that says why, another tenant's is 404;
sampling is metered as its own kind and counts toward the token limits; a cold one is loaded as a cold request.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis
from django.conf import settings as django_settings
from django.core.cache import cache

from adapters.models import RevisionState
from serving import services
from serving.gateway import budgets
from serving.models import USAGE_COUNTS, Placement, PlacementState, Priority, UsageKind, UsagePeriod, UsageRecord
from serving.services.budgets import BUDGET_EVENT_KEY, usage_month_tokens
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import ApiKey, Role, Tenant
from tests.serving.gateway_world import call, complete, gw_revision

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_token_counters():
    def delete() -> None:
        client = redis.Redis.from_url(django_settings.REDIS_URL)
        try:
            for pattern in (f"{budgets.KEY_PREFIX}:*", f"{cache.make_key(BUDGET_EVENT_KEY)}:*"):
                for key in client.scan_iter(match=pattern, count=1000):
                    client.delete(key)
        finally:
            client.close()

    delete()
    yield
    delete()


def exported(world, number: int = 3, *, state: str = RevisionState.EXPORTED, ready: bool = True):
    revision = gw_revision(world.adapter, number, state=state)
    if ready:
        Placement.objects.create(node=world.node_a, revision=revision, state=PlacementState.READY)
    return revision


def key(world, *scopes: str, role: str = Role.OWNER, tenant=None) -> str:
    tenant = tenant or world.tenant_a
    person = tenant.users[role]
    return tenant_services.api_key_create(
        tenant=tenant.tenant,
        name=f"{role}-{'-'.join(scopes)}",
        scopes=list(scopes),
        created_by=person,
        by=Actor(user=tenant.users[Role.OWNER]),
    )[1]


def key_id(world, *scopes: str) -> int:
    return ApiKey.objects.get(tenant=world.tenant_a.tenant, name=f"{Role.OWNER}-{'-'.join(scopes)}").id


def rows(**filters) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(period=UsagePeriod.MINUTE, **filters).order_by("kind", "status"))


# ---------------------------------------------------------------------------------------------
# Who may call which revision


def test_a_pipeline_key_samples_an_exported_revision_without_approval(world):
    revision = exported(world)
    answer = complete(world, key(world, "pipeline"), "support-bot@r3")

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == "support-bot@r3"
    (_, _, sent) = world.vllm.calls[-1]
    assert sent["model"] == f"t{world.tenant_a.tenant.id}-a{world.adapter.id}-r3"
    revision.refresh_from_db()
    assert revision.state == RevisionState.EXPORTED  # sampling approves nothing


@pytest.mark.parametrize("state", [RevisionState.PENDING_APPROVAL, RevisionState.APPROVED])
def test_a_sampling_key_calls_any_frozen_revision_by_number(world, state):
    exported(world, state=state)
    assert complete(world, key(world, "sampling"), "support-bot@r3").status == 200


def test_an_inference_key_gets_403_not_approved_and_nothing_is_loaded(world):
    exported(world, ready=False)
    refused = complete(world, world.token, "support-bot@r3")

    assert refused.status == 403
    error = refused.error()
    assert error["code"] == "revision_not_approved"
    assert "exported, not approved" in error["message"] and "pipeline or sampling" in error["message"]
    world.prewarm.assert_not_called()
    assert world.vllm.calls == []
    # A revision that does not exist is still 404.
    assert complete(world, world.token, "support-bot@r9").error()["code"] == "model_not_found"


def test_another_tenants_pipeline_key_gets_404_as_if_it_did_not_exist(world):
    exported(world)
    other = key(world, "pipeline", tenant=world.tenant_b)
    refused = complete(world, other, "support-bot@r3")
    absent = complete(world, other, "nothing-here@r3")

    assert refused.status == absent.status == 404
    assert refused.error()["message"].replace("support-bot", "nothing-here") == absent.error()["message"]
    assert world.vllm.calls == []


@pytest.mark.parametrize(
    ("state", "code"),
    [
        (RevisionState.REGISTERED, "revision_not_exported"),
        (RevisionState.VALIDATED, "revision_not_exported"),
        (RevisionState.FAILED, "revision_not_sampleable"),
        (RevisionState.REJECTED, "revision_not_sampleable"),
    ],
)
def test_a_revision_a_pipeline_key_cannot_sample_says_why(world, state, code):
    exported(world, state=state, ready=False)
    refused = complete(world, key(world, "pipeline"), "support-bot@r3")

    assert refused.status == 403
    assert refused.error()["code"] == code
    assert state in refused.error()["message"]
    world.prewarm.assert_not_called()


def test_a_sampling_only_key_calls_revisions_by_number_not_aliases(world):
    sampler = key(world, "sampling")
    refused = complete(world, sampler, "support-bot")
    assert refused.status == 403 and refused.error()["code"] == "insufficient_scope"
    assert "support-bot@r<n>" in refused.error()["message"]
    assert complete(world, sampler, "support-bot:candidate").status == 403
    assert complete(world, sampler, "support-bot@r1").status == 200  # approved, by number: sampling too


def test_a_sampling_only_key_lists_no_models(world):
    for scopes in (("sampling",), ("pipeline",)):
        refused = call(world, "GET", "/v1/models", key(world, *scopes))
        assert refused.status == 403 and refused.error()["code"] == "insufficient_scope"
        assert call(world, "GET", "/v1/models/support-bot", key(world, *scopes)).status == 403
    assert call(world, "GET", "/v1/models", key(world, "inference", "pipeline")).status == 200


def test_a_viewers_pipeline_key_may_not_sample(world):
    # Sampling comes with the right to register: a viewer's pipeline key reads the catalog only.
    exported(world)
    refused = complete(world, key(world, "pipeline", role=Role.VIEWER), "support-bot@r3")
    assert refused.status == 403 and refused.error()["code"] == "insufficient_scope"


def test_a_key_with_inference_and_pipeline_scopes_samples_and_infers(world):
    exported(world)
    both = key(world, "inference", "pipeline")
    assert complete(world, both, "support-bot@r3").status == 200
    assert complete(world, both, "support-bot").status == 200


def test_a_cold_sampleable_revision_is_asked_for_at_cold_request_priority(world):
    revision = exported(world, ready=False)
    answer = complete(world, key(world, "pipeline"), "support-bot@r3")

    assert answer.status == 503 and answer.error()["code"] == "adapter_not_ready"
    assert int(answer.headers["Retry-After"]) >= 1
    world.prewarm.assert_called_once()
    assert world.prewarm.call_args.kwargs["priority"] == Priority.COLD_REQUEST
    assert world.prewarm.call_args.kwargs["revision"].id == revision.id


# ---------------------------------------------------------------------------------------------
# Metering and budgets


def test_sampling_is_metered_as_its_own_kind(world):
    exported(world)
    pipeline = key(world, "pipeline")
    both = key(world, "inference", "pipeline")
    assert complete(world, pipeline, "support-bot@r3").status == 200
    assert complete(world, pipeline, "support-bot@r1").status == 200  # approved, by a key that cannot infer
    assert complete(world, both, "support-bot@r3").status == 200  # not approved: its sampling right served it
    assert complete(world, both, "support-bot@r1").status == 200  # approved: inference
    assert complete(world, world.token, "support-bot@r3").status == 403  # refused: an inference request
    world.state.meter.flush()

    sampled = rows(kind=UsageKind.SAMPLING)  # one row per key and revision
    assert sorted((r.key_id, r.revision, r.requests, r.prompt_tokens + r.completion_tokens) for r in sampled) == [
        (key_id(world, "pipeline"), 1, 1, 5),
        (key_id(world, "pipeline"), 3, 1, 5),
        (key_id(world, "inference", "pipeline"), 3, 1, 5),
    ]
    inference = rows(kind=UsageKind.INFERENCE)
    assert sorted((r.revision, r.status, r.requests) for r in inference) == [(0, 403, 1), (1, 200, 1)]


def test_sampling_counts_toward_the_tenants_tokens_per_minute(world):
    exported(world)
    Tenant.objects.filter(pk=world.tenant_a.tenant.pk).update(max_tokens_per_minute=10)
    pipeline = key(world, "pipeline")
    assert [complete(world, pipeline, "support-bot@r3").status for _ in range(3)] == [200, 200, 429]
    # The same limit for the tenant's applications: sampling spent it.
    refused = complete(world, world.token, "support-bot")
    assert refused.status == 429 and refused.error()["code"] == "tokens_per_minute_exceeded"


def test_a_monthly_budget_rebuilt_from_the_database_counts_sampling(world):
    tenant = world.tenant_a.tenant
    first = datetime(2026, 12, 1, tzinfo=UTC)
    values = [0.0] * len(USAGE_COUNTS)
    values[:4] = [1, 60, 20, 5.0]
    values[USAGE_COUNTS.index("lat_0")] = 1
    row = (first, UsageKind.SAMPLING, tenant.id, 0, world.adapter.id, "support-bot", 3, "node-a", 200)
    warmup = (first, UsageKind.WARMUP, *row[2:])
    services.usage_add(counts={row: values, warmup: values})
    assert usage_month_tokens(tenant_id=tenant.id, start=first, end=first.replace(year=2100)) == 80


# ---------------------------------------------------------------------------------------------
# Aliases stay behind approval


def test_an_alias_cannot_be_pointed_at_a_revision_that_is_only_exported(world):
    from mint_site.errors import InvalidTransition

    revision = exported(world)
    with pytest.raises(InvalidTransition):
        services.revision_activate(adapter=world.adapter, revision=revision, by=Actor.system())
    assert call(world, "GET", "/v1/models", key(world, "inference")).json()["data"][0]["id"] == "support-bot"
