"""Every illegal transition is a 409 `invalid_transition` and leaves the state as it was."""

from __future__ import annotations

import pytest

from adapters.models import AdapterRevision, RevisionState
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot"

# action → (path, the one state it may start from, who asks)
ACTIONS = {
    "request-approval": ("revisions/1/request-approval/", RevisionState.EXPORTED, "developer"),
    "approve": ("revisions/1/approve/", RevisionState.PENDING_APPROVAL, "approver"),
    "reject": ("revisions/1/reject/", RevisionState.PENDING_APPROVAL, "approver"),
    "activate": ("activate/", RevisionState.APPROVED, "approver"),
}
CASES = [
    (action, state) for action, (_, legal, _) in ACTIONS.items() for state in RevisionState.values if state != legal
]


@pytest.mark.parametrize(("action", "state"), CASES)
def test_illegal_transition_is_409_and_changes_nothing(tenant_a, adapter_a, action, state):
    revision = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=state, source_uri="x", created_by=tenant_a.users["developer"]
    )
    path, _, who = ACTIONS[action]
    body = {"revision": 1} if action == "activate" else {}
    response = tenant_a.client_as(who).post(f"{URL}/{path}", body, format="json")
    assert response.status_code == 409, response.content
    error = error_of(response)
    assert error["code"] == "invalid_transition"
    assert state in error["message"]
    revision.refresh_from_db()
    assert revision.state == state


@pytest.mark.parametrize("action", list(ACTIONS))
def test_legal_transition_succeeds(tenant_a, adapter_a, action):
    path, legal, who = ACTIONS[action]
    AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=legal, source_uri="x", created_by=tenant_a.users["developer"]
    )
    body = {"revision": 1} if action == "activate" else {"comment": "Not this one."} if action == "reject" else {}
    response = tenant_a.client_as(who).post(f"{URL}/{path}", body, format="json")
    assert response.status_code == 200, response.content


def test_service_transitions_check_state_in_the_database_not_in_memory(tenant_a, adapter_a):
    from adapters import services
    from mint_site.errors import InvalidTransition
    from tenants.access import Actor

    revision = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="exported", source_uri="x")
    stale = AdapterRevision.objects.get(id=revision.id)
    services.revision_request_approval(revision=revision, by=Actor.system())
    with pytest.raises(InvalidTransition):
        services.revision_request_approval(revision=stale, by=Actor.system())  # stale copy still says exported
    assert AdapterRevision.objects.get(id=revision.id).state == "pending_approval"
