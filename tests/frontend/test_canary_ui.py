"""Canary rollout on the dashboard: the activate form takes a canary percent, the alias panel shows the canary with
its per-arm counters, Promote and Abort act through the same services as the API, roles and tenants are kept."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from adapters.models import AdapterRevision
from mint_site.events import epoch_us
from serving.models import Alias
from serving.services import canary
from tenants.models import AuditEvent
from tests.frontend.conftest import page_client
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db

PAGE = "/adapters/support-bot/"


@pytest.fixture(autouse=True)
def quiet():
    """Node-agent tasks and convergence recorded instead of sent."""
    with (
        recorded(*NODE_TASKS, "alias_converge"),
    ):
        yield


@pytest.fixture
def candidate(catalog_a) -> AdapterRevision:
    """r4: approved, exported, the revision a canary tries next to the live r2."""
    return AdapterRevision.objects.create(
        adapter=catalog_a.adapter, number=4, state="approved", source_uri="x", export_uri="exports/4"
    )


def _start(as_role, percent="20") -> str:
    response = as_role("approver").post(f"{PAGE}activate/", {"revision": "4", "canary_percent": percent}, follow=True)
    return response.content.decode()


def _alias(catalog) -> Alias:
    return Alias.objects.get(adapter=catalog.adapter, name="production")


def test_the_activate_form_offers_a_canary_percent(catalog_a, candidate, as_role):
    content = as_role("approver").get(PAGE).content.decode()
    assert 'name="canary_percent"' in content and 'min="1" max="50"' in content


def test_activating_with_a_percent_starts_a_canary_and_keeps_the_live_revision(catalog_a, candidate, as_role):
    content = _start(as_role)
    assert "Canary of r4 on production: 20 % of its requests go to it once it is ready" in content
    alias = _alias(catalog_a)
    assert alias.revision_id == catalog_a.approved.id and alias.canary_revision_id == candidate.id
    assert alias.canary_percent == 20
    assert 'data-canary="production"' in content and "once ready" in content
    assert 'data-action="promote"' in content and 'data-action="abort"' in content


@pytest.mark.parametrize("percent", ["0", "51", "ten"])
def test_a_percent_outside_1_to_50_is_named_and_changes_nothing(catalog_a, candidate, as_role, percent):
    content = _start(as_role, percent)
    assert "Canary percent" in content
    assert _alias(catalog_a).canary_revision_id is None


def test_the_panel_shows_each_arms_counters(catalog_a, candidate, as_role):
    _start(as_role)
    alias = _alias(catalog_a)
    key = canary.counter_key(alias.id, epoch_us(alias.canary_started_at))
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.hset(key, mapping={"c:req": 40, "c:err": 4, "l:req": 160, "l:err": 0, "c:b3": 40, "l:b2": 160})
    try:
        content = as_role("viewer").get(PAGE).content.decode()
    finally:
        client.delete(key)
    candidate_row = content.split('data-arm="candidate"')[1].split("</tr>")[0]
    live_row = content.split('data-arm="live"')[1].split("</tr>")[0]
    assert "<td>40</td><td>4</td><td>10 %</td>" in candidate_row and "100 ms" in candidate_row
    assert "<td>160</td><td>0</td><td>0 %</td>" in live_row and "50 ms" in live_row


def test_viewers_see_the_canary_without_buttons(catalog_a, candidate, as_role):
    _start(as_role)
    content = as_role("viewer").get(PAGE).content.decode()
    assert 'data-canary="production"' in content
    assert 'data-action="promote"' not in content and 'data-action="abort"' not in content
    for action in ("promote", "abort"):
        assert as_role("viewer").post(f"{PAGE}{action}/", {"alias": "production"}).status_code == 403
        assert as_role("developer").post(f"{PAGE}{action}/", {"alias": "production"}).status_code == 403
    assert _alias(catalog_a).canary_revision_id == candidate.id


def test_abort_drops_the_canary_with_the_reason_audited(catalog_a, candidate, as_role):
    _start(as_role)
    response = as_role("approver").post(
        f"{PAGE}abort/", {"alias": "production", "reason": "answers too long"}, follow=True
    )
    assert "Canary aborted: production sends every request to r2." in response.content.decode()
    alias = _alias(catalog_a)
    assert alias.canary_revision_id is None and alias.revision_id == catalog_a.approved.id
    event = AuditEvent.objects.filter(tenant=catalog_a.adapter.tenant, action="canary.abort").get()
    assert event.after["reason"] == "answers too long" and event.before["canary"].endswith("r4")


def test_promote_makes_the_candidate_desired(catalog_a, candidate, as_role):
    _start(as_role)
    response = as_role("approver").post(f"{PAGE}promote/", {"alias": "production"}, follow=True)
    assert "Promoted: production serves r4" in response.content.decode()
    alias = _alias(catalog_a)
    assert alias.canary_revision_id is None and alias.desired_revision_id == candidate.id


def test_promote_or_abort_without_a_canary_says_so(catalog_a, as_role):
    for action in ("promote", "abort"):
        response = as_role("approver").post(f"{PAGE}{action}/", {"alias": "production"}, follow=True)
        assert response.status_code == 200
        assert "no canary" in response.content.decode().lower()


def test_another_tenants_approver_cannot_touch_the_canary(catalog_a, candidate, as_role, tenant_b):
    _start(as_role)
    outsider = page_client(tenant_b.users["approver"])
    for action in ("promote", "abort"):
        assert outsider.post(f"{PAGE}{action}/", {"alias": "production"}).status_code == 404
    alias = _alias(catalog_a)
    assert alias.canary_revision_id == candidate.id and alias.desired_revision_id == catalog_a.approved.id
    assert not AuditEvent.objects.filter(action__in=["canary.promote", "canary.abort"]).exists()
