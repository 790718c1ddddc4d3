"""Staff also follow the platform group, which carries every tenant's events: the socket still never shows
another tenant's names to them, and an event of their own tenant arrives once, not once per group."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from tests.frontend.test_live_events import EVENT_S, QUIET_S, communicator, exported_revision, request_approval

pytestmark = pytest.mark.django_db(transaction=True)


def test_staff_member_of_a_sees_b_only_without_names_and_a_once(tenant_a, tenant_b, adapter_a, adapter_b):
    staff = tenant_a.users["approver"]
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    rev_a, rev_b = exported_revision(adapter_a), exported_revision(adapter_b)
    ws = communicator(staff, query="?tenant=acme")

    async def scenario():
        assert (await ws.connect())[0]
        await sync_to_async(request_approval)(rev_b)
        await sync_to_async(request_approval)(rev_a)
        received = []
        # Other staff tests on this Redis share the platform group: keep only these two revisions' events.
        while True:
            event = await ws.receive_json_from(timeout=EVENT_S)
            if event.get("type") == "revision.state" and event["id"] in (rev_a.id, rev_b.id):
                received.append(event)
            if any(e["id"] == rev_a.id for e in received):
                break
        assert await ws.receive_nothing(QUIET_S)
        await ws.disconnect()
        return received

    received = async_to_sync(scenario)()
    by_id = {e["id"]: e for e in received}
    assert len(received) == 2, received  # one each: A's did not come twice (tenant and platform group)
    assert by_id[rev_a.id]["adapter"] == "support-bot"
    assert set(by_id[rev_b.id]) <= {"type", "id", "state", "at", "node"}
    assert "globex" not in str(received)
